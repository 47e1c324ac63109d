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
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
