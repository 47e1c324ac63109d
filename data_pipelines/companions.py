"""Files a clip is read with: its loss mask (data.masks) and its control video (cond.control).
docs/conditioning.md#masked-loss and #control describe them for users.

Where they come from:

  folder    clip.mask.<ext> and clip.control.<ext> beside clip.<ext> (any video or image
            extension; a folder scan never takes them for clips of their own)
  manifest  columns `mask` and `control` (paths like `path`: relative to the manifest's folder,
            or absolute), or `mask_boxes` instead of a mask video

`mask_boxes` (JSON; in a CSV cell, its JSON text) gives boxes in the clip's native pixel
coordinates, [x0, y0, x1, y1] (x across, y down, x1 and y1 excluded) with an optional fifth
number, the weight inside (in [0, 1], default 1); where boxes overlap the larger weight counts,
outside every box the weight is 0. Either one list of boxes for every frame,
`[[0, 0, 16, 32], [16, 0, 32, 32, 0.5]]`, or one list per frame of the video (as many lists as
it has frames, an empty list for a frame without boxes): `[[[0, 0, 8, 8]], [], ...]`.

A companion is read with its clip's frame indices, resized and cropped the way its clip is
(VideoClipDataset), so the two stay aligned. Problems found here are kept as text and raised
when the clip is read: the clip is skipped and counted like an unreadable video.

A mask becomes token weights in exact integer units (mask_weight_units): a pixel clip's tokens
from its 8-bit mask directly; a latent cache stores the mask summed over each latent voxel's
pixels (latent_mask_sums, `tools.cache_latents --masks`), and its tokens take the same rounded
mean over their pixels (LatentMask).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from einops import rearrange

from dit_train.batch import WEIGHT_ONE

KINDS = ("mask", "control")
# what a user sets to need each kind, for messages
KEYS = {"mask": "data.masks", "control": "cond.control"}


@dataclass(frozen=True)
class Companions:
    """A clip's companion files. mask / control: paths ("" = none); boxes: the parsed
    mask_boxes (see parse_boxes; None = none); problem: why the manifest's companion columns
    cannot be used ("" = they can)."""

    mask: str = ""
    control: str = ""
    boxes: Any = None
    problem: str = ""

    def has(self, kind: str) -> bool:
        return bool(self.mask or self.boxes is not None) if kind == "mask" else bool(self.control)


NONE = Companions()


def row_path(base: Path, path: str) -> str:
    """A manifest's path cell as an absolute path (relative ones from the manifest's folder)."""
    return path if Path(path).is_absolute() else str((base / path).resolve())


def split_companion(path: Path) -> tuple[str, str] | None:
    """("clip", "mask") for clip.mask.mp4, ("clip", "control") for clip.control.png; else None."""
    stem = path.stem
    for kind in KINDS:
        if stem.lower().endswith("." + kind) and len(stem) > len(kind) + 1:
            return stem[: -len(kind) - 1], kind
    return None


def companion_files(media: list[Path]) -> set[Path]:
    """The files of `media` that are companions of another file of `media` (clip.mask.mp4 when
    clip.mp4 or clip.png is there): a folder scan leaves them out of the clips."""
    stems = {(p.parent, p.stem) for p in media}
    return {p for p in media if (s := split_companion(p)) is not None and (p.parent, s[0]) in stems}


def folder_companions(paths: list[str]) -> dict[str, Companions]:
    """{clip path: its companions} found beside each clip (one directory listing per folder)."""
    listing: dict[Path, dict[tuple[str, str], str]] = {}
    out = {}
    for path in paths:
        p = Path(path)
        if p.parent not in listing:
            found: dict[tuple[str, str], str] = {}
            for q in sorted(p.parent.iterdir()) if p.parent.is_dir() else []:
                if (s := split_companion(q)) is not None:
                    found.setdefault((s[0], s[1]), str(q))
            listing[p.parent] = found
        found = listing[p.parent]
        out[path] = Companions(mask=found.get((p.stem, "mask"), ""), control=found.get((p.stem, "control"), ""))
    return out


def row_companions(row: dict, base: Path) -> Companions:
    """The companions named by a manifest row's `mask`, `control` and `mask_boxes` columns."""
    paths, problems = {}, []
    for kind in KINDS:
        cell = row.get(kind)
        if cell is None or cell == "":
            paths[kind] = ""
        elif isinstance(cell, str):
            paths[kind] = row_path(base, cell)
        else:
            paths[kind] = ""
            problems.append(f'"{kind}" is not a path ({type(cell).__name__})')
    boxes, why = parse_boxes(row.get("mask_boxes"))
    if why:
        problems.append(f'"mask_boxes" {why}')
    return Companions(paths["mask"], paths["control"], boxes, "; ".join(problems))


def _box(b: Any) -> tuple[tuple[int, int, int, int, float] | None, str]:
    if not isinstance(b, list) or len(b) not in (4, 5) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                  for v in b):
        return None, f"has {json.dumps(b)} where a box [x0, y0, x1, y1] or [x0, y0, x1, y1, weight] belongs"
    if not all(math.isfinite(v) for v in b):
        return None, f"box {b} is not finite"
    x0, y0, x1, y1 = (int(round(v)) for v in b[:4])
    value = float(b[4]) if len(b) == 5 else 1.0
    if not 0.0 <= value <= 1.0:
        return None, f"box {b}: weight {value:g} is outside [0, 1]"
    if x1 < x0 or y1 < y0:
        return None, f"box {b}: x1 < x0 or y1 < y0"
    return (x0, y0, x1, y1, value), ""


def parse_boxes(value: Any) -> tuple[Any, str]:
    """(boxes, "") from a mask_boxes cell, or (None, why). None / "" -> (None, ""): no boxes.
    boxes: ("all", [box, ...]) for one list of every frame, ("frames", [[box, ...], ...]) per
    frame; a box is (x0, y0, x1, y1, weight)."""
    if value is None or value == "":
        return None, ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            return None, f"is not JSON ({e.msg})"
    if not isinstance(value, list):
        return None, f"must be a list of boxes, not {type(value).__name__}"
    per_frame = bool(value) and all(isinstance(f, list) and all(isinstance(b, list) for b in f) for f in value)
    groups = value if per_frame else [value]
    parsed = []
    for group in groups:
        boxes = []
        for b in group:
            box, why = _box(b)
            if why:
                return None, why
            boxes.append(box)
        parsed.append(boxes)
    return (("frames", parsed) if per_frame else ("all", parsed[0])), ""


def box_frames(boxes: Any, indices: list[int], frames: int, height: int, width: int) -> torch.Tensor:
    """uint8 [F, H, W, 1]: the mask of parsed `boxes` at frames `indices` of a clip of `frames`
    frames at its native (height, width); weight w -> round(255·w). ValueError when per-frame
    boxes do not list one entry per frame."""
    how, data = boxes
    if how == "frames" and len(data) != frames:
        raise ValueError(f"mask_boxes lists {len(data)} frames, the video has {frames}")
    out = torch.zeros(len(indices), height, width, 1, dtype=torch.uint8)
    for k, j in enumerate(indices):
        for x0, y0, x1, y1, value in data[j] if how == "frames" else data:
            region = out[k, max(0, y0):max(0, y1), max(0, x0):max(0, x1)]
            region.clamp_(min=round(255 * value))
    return out


def missing(kind: str, clip: str) -> str:
    """Why a clip without a `kind` companion cannot be read when its key is on."""
    stem = os.path.splitext(os.path.basename(clip))[0]
    column = "a `mask` or `mask_boxes`" if kind == "mask" else "a `control`"
    return (f"{clip} has no {kind} ({KEYS[kind]}=true): put {stem}.{kind}.mp4 beside it, or give the manifest "
            f"{column} column")


def none_found(kind: str) -> str:
    """The error when no clip of the data has a `kind` companion (a config-level mistake)."""
    column = "a `mask` or `mask_boxes`" if kind == "mask" else "a `control`"
    return (f"{KEYS[kind]}=true but no clip of the data has a {kind}: put clip.{kind}.mp4 beside clip.mp4, or give "
            f"the manifest {column} column (docs/conditioning.md), or set {KEYS[kind]}=false")


# -- masks as token weights (exact integer units of 1/WEIGHT_ONE) ----------------------------------


def patch_unit_sums(units: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[T] int64: the sum of `units` [F, H, W] (integers) over each (pt, ph, pw) patch, in
    patchify's (t, h, w) order; each side cut down to the patch."""
    pt, ph, pw = patch
    F, H, W = units.shape
    f, h, w = F // pt, H // ph, W // pw
    m = units[: f * pt, : h * ph, : w * pw].to(torch.int64)
    return rearrange(m, "(f pt) (h ph) (w pw) -> (f h w) (pt ph pw)", pt=pt, ph=ph, pw=pw).sum(-1)


def rounded_mean(sums: torch.Tensor, n: int) -> torch.Tensor:
    """sums / n rounded to the nearest integer (halves up), in integer arithmetic."""
    return (2 * sums + n) // (2 * n)


def mask_weight_units(mask: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """An 8-bit mask [F, H, W] (uint8, 255 = fully supervised) -> [T] int64 token weights in
    units of 1/WEIGHT_ONE: each token's mean mask value over its patch, k/255 = 257·k units,
    rounded to the nearest unit in integer arithmetic (exact, the same on every machine)."""
    pt, ph, pw = patch
    return rounded_mean(patch_unit_sums(mask.to(torch.int64) * (WEIGHT_ONE // 255), patch), pt * ph * pw)


def latent_mask_sums(mask: torch.Tensor, temporal: int, spatial: int) -> torch.Tensor:
    """int64 [f, h, w]: an 8-bit mask [F, H, W] of a clip's pixels summed in units over each latent
    voxel's pixels — a causal video VAE's latent frame 0 is pixel frame 0 alone, latent frame j
    frames t·j - t + 1 .. t·j; frame 0 counts t times, so every voxel sums t·s·s pixel values
    (F = 1 + t·(f - 1): the frames the VAE encodes; H, W multiples of s)."""
    frames = torch.cat([mask[:1].expand(temporal, *mask.shape[1:]), mask[1:]])
    f = 1 + (mask.shape[0] - 1) // temporal
    sums = patch_unit_sums(frames.to(torch.int64) * (WEIGHT_ONE // 255), (temporal, spatial, spatial))
    return sums.view(f, mask.shape[1] // spatial, mask.shape[2] // spatial)


@dataclass
class LatentMask:
    """A cached clip's mask on its latent grid (latent_mask_sums): `sums` [f, h, w] int64 units,
    each over `pixels` pixel values (t·s·s). A token's weight is the rounded mean over all the
    pixels of its patch's voxels: mask_weight_units of the pixel mask at patch (pt·t, ph·s, pw·s)
    (latent frame 0 as its frame repeated t times), the same integers."""

    sums: torch.Tensor
    pixels: int

    @property
    def shape(self) -> torch.Size:
        return self.sums.shape

    def __getitem__(self, frames: slice) -> LatentMask:
        """The mask of some of the clip's latent frames (a block-causal run's whole blocks)."""
        return LatentMask(self.sums[frames], self.pixels)

    def token_units(self, patch: tuple[int, int, int]) -> torch.Tensor:
        pt, ph, pw = patch
        return rounded_mean(patch_unit_sums(self.sums, patch), self.pixels * pt * ph * pw)


def token_mask_units(mask: Any, patch: tuple[int, int, int]) -> torch.Tensor:
    """[T] int64 token weights of a clip's mask: an 8-bit pixel mask [F, H, W] (mask_weight_units)
    or a latent cache's LatentMask."""
    return mask.token_units(patch) if isinstance(mask, LatentMask) else mask_weight_units(mask, patch)
