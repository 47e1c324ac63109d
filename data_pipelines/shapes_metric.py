"""Exact scores of a clip against its caption in the embedded shapes world (a GenEval for it).

A caption of `data_pipelines/synthetic_video.py` states a shape colour, a shape kind, a
direction and a background; `score_clip` checks each statement on the pixels and returns one
figure in [0, 1] per statement, so a failure says which statement the clip got wrong. Each
figure compares one statement with what the clip shows (its dominant palette colours, the blob
of the shape colour): a wrong background word fails background_ok only, a wrong colour word
color_ok only, and so on; all_ok is their conjunction.

Pixels are RGB in 0..255. A pixel is "near" a palette colour when their Euclidean RGB distance
is <= PALETTE_TOL. Generated clips ([3, F, H, W] floats in [-1, 1]) are clamped first.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dit_train.data_pipelines.synthetic_video import BACKGROUNDS, COLORS, SHAPES
from dit_train.data_pipelines.video_io import probe, read_frames

PALETTE_NAMES: tuple[str, ...] = (*COLORS, *BACKGROUNDS)
PALETTE = np.array([*COLORS.values(), *BACKGROUNDS.values()], np.float32)  # [12, 3]
NUM_SHAPE_COLORS = len(COLORS)  # PALETTE[:8] are shape colours, PALETTE[8:] backgrounds
# Below half the smallest palette gap (black-navy, 61.6), so "near" names at most one colour.
# H.264 at crf 12 keeps flat regions within ~5 of the palette; what it moves further are the
# edge pixels (4:2:0 chroma is at half resolution). 24 keeps ~98% of decoded real pixels and
# lets ~3.6% of uniform or Gaussian noise pixels through.
PALETTE_TOL = 24.0
BACKGROUND_MIN_SHARE = 0.5  # the shape covers at most 25% of a frame (half-size <= 0.25 min(H, W))
COLOR_MIN_SHARE = 0.5  # of the pixels near any shape colour (noise spreads them over all eight)
BLOB_MIN_EXACT = 0.2  # a blob is the shape only if this share of its pixels is near the shape colour
BLOB_MIN_AREA = 0.01  # ... and covers this x min(H, W)^2 pixels (the smallest real one: ~0.035)
SIGNIFICANT = 0.25  # components smaller than this share of the clip's blob size are specks
SINGLE_MIN_FRAMES = 0.8  # single_shape: share of frames showing exactly one blob of about that size
STEADY_SIZE = 2.0  # ... "about": within this factor of the clip's median (H.264 moves small ones ~1.6x)
FILL_SPLIT = 0.92  # fill ratio: disc pi/4 (~0.80; tiny discs reach 0.94), square 1 (H.264: >= 0.945)
MOTION_STEPS = 4  # the velocity at the start: mean of the first displacements before the first bounce
MIN_SPEED = 0.5  # px/frame: a shape moving slower is not "moving" (real clips: >= 1)
MIN_AXIS_SPEED = 0.2  # px/frame: slower components have no measurable sign; either word passes
WALL_BAND = 0.75  # px: a shape starting this close to a wall (beyond its first step) may bounce at once
# the keys of score_clip, in order (motion_ok only where motion is scored)
FIGURES = ("palette_share", "background_ok", "color_ok", "shape_ok", "single_shape", "motion_ok", "all_ok")


@dataclass(frozen=True)
class ShapeCaption:
    color: str
    shape: str
    vertical: str | None  # "up" / "down"; None for a still-image caption
    horizontal: str | None  # "left" / "right"
    background: str

    @property
    def has_motion(self) -> bool:
        return self.vertical is not None


_CAPTION = re.compile(r"an? (\w+) (\w+)(?: moving (up|down) and (left|right))? on an? (\w+) background\.?")


def parse_caption(caption: str) -> ShapeCaption | None:
    """'a red circle moving up and left on a navy background' (clip) or 'a red circle on a navy
    background' (still image) -> ShapeCaption; None for any other caption."""
    m = _CAPTION.fullmatch(caption.strip().lower())
    if m is None or m[1] not in COLORS or m[2] not in SHAPES or m[5] not in BACKGROUNDS:
        return None
    return ShapeCaption(m[1], m[2], m[3], m[4], m[5])


def to_rgb(clip: torch.Tensor | np.ndarray) -> np.ndarray:
    """uint8 [F, H, W, 3] or float [3, F, H, W] in [-1, 1] (clamped) -> float32 [F, H, W, 3] in 0..255."""
    if isinstance(clip, torch.Tensor):  # samples may be bf16, which numpy cannot hold
        clip = clip.detach().cpu()
        clip = clip if clip.dtype == torch.uint8 else clip.float()
    x = np.asarray(clip)
    if x.dtype == np.uint8:  # the decoded layout; anything else is the model's
        return x.astype(np.float32)
    x = np.clip(x.astype(np.float32), -1.0, 1.0)
    return np.ascontiguousarray(np.moveaxis((x + 1.0) * 127.5, 0, -1))


def palette_labels(rgb: np.ndarray) -> np.ndarray:
    """float [..., 3] in 0..255 -> int64 [...]: index into PALETTE of the colour within
    PALETTE_TOL, -1 where none is."""
    dist = np.linalg.norm(rgb[..., None, :] - PALETTE, axis=-1)  # [..., 12]
    return np.where(dist.min(-1) <= PALETTE_TOL, dist.argmin(-1), -1)


def components(mask: np.ndarray) -> np.ndarray:
    """8-connected components of each frame of a bool [F, H, W] mask -> int64 [F, H, W]: -1 off
    the mask, else the smallest flat index of the component's pixels (an id unique in the clip).

    Union-find over the mask's neighbour pairs, vectorised: every round hooks the larger root of
    each pair that still disagrees onto the smaller one and then compresses every path, so a
    component's root is its smallest index. Rounds grow roughly with the log of a component's
    extent, where propagating labels pixel by pixel needs its length (noise makes long chains).
    Frames never touch.
    """
    idx = np.arange(mask.size).reshape(mask.shape)
    whole = slice(None)
    # each 8-neighbour pair once: right, down, down-right, down-left
    offsets = [((whole, slice(0, -1)), (whole, slice(1, None))),
               ((slice(0, -1), whole), (slice(1, None), whole)),
               ((slice(0, -1), slice(0, -1)), (slice(1, None), slice(1, None))),
               ((slice(0, -1), slice(1, None)), (slice(1, None), slice(0, -1)))]
    a_parts, b_parts = [], []
    for (ya, xa), (yb, xb) in offsets:
        both = mask[:, ya, xa] & mask[:, yb, xb]
        a_parts.append(idx[:, ya, xa][both])
        b_parts.append(idx[:, yb, xb][both])
    a, b = np.concatenate(a_parts), np.concatenate(b_parts)
    parent = idx.reshape(-1).copy()
    on = np.flatnonzero(mask)
    while True:
        ra, rb = parent[a], parent[b]
        apart = ra != rb
        if not apart.any():
            return np.where(mask, parent.reshape(mask.shape), -1)
        a, b, ra, rb = a[apart], b[apart], ra[apart], rb[apart]
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))
        cur = parent[on]
        while True:  # path compression: every pixel points at its root
            up = parent[cur]
            if np.array_equal(up, cur):
                break
            parent[on] = cur = up


def _dilate(mask: np.ndarray) -> np.ndarray:
    """bool [H, W] grown by one pixel (3x3)."""
    H, W = mask.shape
    pad = np.pad(mask, 1)
    return np.logical_or.reduce([pad[dy:dy + H, dx:dx + W] for dy in range(3) for dx in range(3)])


@dataclass
class _Blobs:
    """Per frame: the shape's blob (the largest valid component) and how many blobs of similar size."""
    size: np.ndarray  # [F] pixels of the blob, 0 where the frame has none
    count: np.ndarray  # [F] valid components >= SIGNIFICANT x the clip's median blob size
    fill: np.ndarray  # [F] area / (widest row x tallest column), soft coverage; nan without blob
    center: np.ndarray  # [F, 2] (x, y) centroid of the soft coverage, pixel-centre coordinates
    half: np.ndarray  # [F, 2] half the widest row / tallest column (the half-size r)
    exact: int  # pixels near the shape colour that lie in a blob (of any frame)


def _blobs(rgb: np.ndarray, labels: np.ndarray, bg: int, shape: int) -> _Blobs:
    """Find the shape in every frame of rgb [F, H, W, 3] given the palette indices of the
    background and shape colours.

    Coverage t in [0, 1] is where the pixel lies between the two colours (projection on the
    segment): H.264 mixes them at edges, and its half-resolution chroma pushes edge pixels off
    the palette, so the blob is every pixel nearer the shape colour than the background (t >=
    0.5) that is not near a third palette colour. Noise makes such pixels everywhere; a blob
    therefore counts only if enough of it is near the shape colour itself (BLOB_MIN_EXACT).
    """
    F, H, W, _ = rgb.shape
    seg = PALETTE[shape] - PALETTE[bg]
    t = np.clip((rgb - PALETTE[bg]) @ seg / float(seg @ seg), 0.0, 1.0)
    other = (labels >= 0) & (labels != bg) & (labels != shape)
    comp = components((t >= 0.5) & ~other)
    exact = labels == shape
    per_frame, in_blobs = [], 0
    for f in range(F):
        ids, sizes = np.unique(comp[f][comp[f] >= 0], return_counts=True)
        n_exact = np.bincount(np.searchsorted(ids, comp[f][exact[f] & (comp[f] >= 0)]), minlength=len(ids))
        ok = (n_exact >= BLOB_MIN_EXACT * sizes) & (sizes >= BLOB_MIN_AREA * min(H, W) ** 2)
        per_frame.append((ids[ok], sizes[ok]))
        in_blobs += int(n_exact[ok].sum())
    largest = np.array([s.max() if len(s) else 0 for _, s in per_frame])
    typical = np.median(largest[largest > 0]) if (largest > 0).any() else 0.0
    out = _Blobs(largest, np.zeros(F, np.int64), np.full(F, np.nan), np.full((F, 2), np.nan), np.full((F, 2), np.nan),
                 in_blobs)
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    for f, (ids, sizes) in enumerate(per_frame):
        if not len(ids):
            continue
        out.count[f] = int((sizes >= SIGNIFICANT * typical).sum())
        cov = np.where(_dilate(comp[f] == ids[sizes.argmax()]) & ~other[f], t[f], 0.0)  # blurred rim included
        area, row, col = cov.sum(), cov.sum(1).max(), cov.sum(0).max()
        out.fill[f] = area / (row * col)
        out.center[f] = (cov * xx).sum() / area, (cov * yy).sum() / area
        out.half[f] = row / 2, col / 2
    return out


def _start_velocity(d: np.ndarray) -> float:
    """Mean of the first displacements [k] along one axis before the first bounce: the first
    step against the direction of the first clear step (>= MIN_AXIS_SPEED). A slow shape moves
    in whole pixels (steps of 0 are no bounce)."""
    big = np.flatnonzero(np.abs(d) >= MIN_AXIS_SPEED)
    if not len(big):
        return float(d.mean())
    back = np.flatnonzero(np.sign(d) == -np.sign(d[big[0]]))
    back = back[back > big[0]]
    return float(d[: back[0] if len(back) else len(d)].mean())


def _axis_ok(word_sign: int, c: float, v: float, half: float, length: int) -> bool:
    """Does the start of the motion along one axis (first-frame position c, start velocity v,
    half-size, frame length) show the caption's sign (+1 = right / down)? A shape that starts
    against the wall the caption points to bounces in its first step (the renderer moves, then
    reflects): it may show the other sign, so either passes there."""
    if abs(v) < MIN_AXIS_SPEED or int(np.sign(v)) == word_sign:
        return True
    room = length - (c + half) if word_sign > 0 else c - half  # to the wall the caption points to
    return room <= abs(v) + WALL_BAND


def _motion_ok(blobs: _Blobs, cap: ShapeCaption, height: int, width: int) -> bool:
    """Velocity at the start (_start_velocity of the first MOTION_STEPS frame-to-frame centroid
    displacements, from the frames that show the blob) against the caption's words."""
    have = np.flatnonzero(blobs.size > 0)
    if len(have) < 2 or have[0] != 0:
        return False
    c = blobs.center[have]
    d = (np.diff(c, axis=0) / np.diff(have)[:, None])[:MOTION_STEPS]  # [k, 2] px/frame
    v = np.array([_start_velocity(d[:, a]) for a in range(2)])
    if np.hypot(*v) < MIN_SPEED:
        return False
    signs = (1 if cap.horizontal == "right" else -1, 1 if cap.vertical == "down" else -1)
    return all(_axis_ok(signs[a], c[0, a], v[a], blobs.half[0, a], (width, height)[a]) for a in range(2))


def score_clip(clip: torch.Tensor | np.ndarray, caption: str | ShapeCaption) -> dict[str, float]:
    """Figures in [0, 1] for one clip (uint8 [F, H, W, 3] or float [3, F, H, W] in [-1, 1]):

    palette_share  share of pixels near some palette colour (8 shape + 4 background colours).
    background_ok  the palette colour most pixels are near is the caption's background and
                   covers >= BACKGROUND_MIN_SHARE of the pixels (noise never does).
    color_ok       the shape colour most pixels are near (the background excluded) is the
                   caption's; its pixels are >= COLOR_MIN_SHARE of the pixels near any shape
                   colour, >= BLOB_MIN_AREA x min(H, W)^2 per frame on average, and mostly
                   (half) inside blobs: a coloured shape, not scattered coloured pixels.
    shape_ok       half the frames or more show a blob, and its median fill ratio (coverage over
                   widest row x tallest column: disc pi/4, square 1) is on the caption's side of
                   FILL_SPLIT.
    single_shape   >= SINGLE_MIN_FRAMES of the frames show exactly one blob of the shape colour
                   (components under SIGNIFICANT x the clip's median blob size are specks),
                   and its size is within a factor STEADY_SIZE of that median.
    motion_ok      only for >= 2 frames and a caption with a direction: the blob is in the first
                   frame, moves >= MIN_SPEED px/frame at the start (before any bounce), and each
                   axis's sign matches the caption (see _axis_ok for a start against a wall).
    all_ok         background, colour, shape and (where scored) motion all right.
    """
    cap = _caption(caption)
    return _scores(_look(to_rgb(clip)), cap)


def _caption(caption: str | ShapeCaption) -> ShapeCaption:
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    if cap is None:
        raise ValueError(f"not a caption of the shapes world: {caption!r}")
    return cap


def _scores(look: "_Look", cap: ShapeCaption) -> dict[str, float]:
    """score_clip's figures of what a clip shows (`_look`) against its caption."""
    F, H, W = look.dims
    blobs = look.blobs
    seen = blobs.size > 0
    typical = np.median(blobs.size[seen]) if seen.any() else 0.0
    steady = (blobs.count == 1) & (blobs.size <= STEADY_SIZE * typical) & (blobs.size >= typical / STEADY_SIZE)
    out = {
        "palette_share": look.palette_share,
        "background_ok": float(PALETTE_NAMES[look.bg] == cap.background and look.background),
        "color_ok": float(PALETTE_NAMES[look.shape] == cap.color and look.colored),
        "shape_ok": float(look.seen >= 0.5 and look.square == (cap.shape == "square")),
        "single_shape": float(seen.any() and steady.mean() >= SINGLE_MIN_FRAMES),
    }
    checks = [out["background_ok"], out["color_ok"], out["shape_ok"]]
    if F >= 2 and cap.has_motion:
        out["motion_ok"] = float(_motion_ok(blobs, cap, H, W))
        checks.append(out["motion_ok"])
    out["all_ok"] = float(all(checks))
    return out


# the graded shape figure: the median fill ratio mapped from a disc's (pi/4 ~ 0.79; generated
# blobs sit at 0.82-0.88, between the two kinds) to a square's (>= 0.97) as 0 .. 1
FILL_DISC, FILL_SQUARE = 0.80, 0.97


def shape_grade(clip: torch.Tensor | np.ndarray, caption: str | ShapeCaption) -> float:
    """How far the clip's blob is toward the caption's shape kind, in [0, 1]: shape_ok's fill ratio
    (median over the frames that show the blob) on a scale from a disc (0) to a square (1),
    reversed for a circle caption; 0 when half the frames or more show no blob.

    shape_ok is a threshold of the same ratio: a model that draws one rounded blob for both words
    scores every clip of a square caption 0 and of a circle caption 1, so a group of clips of one
    caption has no spread to learn from (docs/video-rl.md). The grade moves with the blob."""
    return _grade(_look(to_rgb(clip)), _caption(caption))


def scores_and_grade(clip: torch.Tensor | np.ndarray, caption: str | ShapeCaption) -> tuple[dict[str, float], float]:
    """(score_clip, shape_grade) of one clip, its pixels read once."""
    cap, look = _caption(caption), _look(to_rgb(clip))
    return _scores(look, cap), _grade(look, cap)


def _grade(look: "_Look", cap: ShapeCaption) -> float:
    if look.seen < 0.5:
        return 0.0
    fill = float(np.median(look.blobs.fill[look.blobs.size > 0]))
    toward_square = min(1.0, max(0.0, (fill - FILL_DISC) / (FILL_SQUARE - FILL_DISC)))
    return toward_square if cap.shape == "square" else 1.0 - toward_square


def score_clips(clips: list[torch.Tensor | np.ndarray], captions: list[str]) -> dict[str, float]:
    """Means of `score_clip` over the clips whose caption is of this world, keys prefixed eval/.

    eval/motion_ok averages over the clips where motion is scored; eval/num_clips counts the
    clips scored, eval/num_skipped those whose caption is not of this world. When the set mixes
    still images (1 frame) and clips, the same means also come as eval/image/... and
    eval/video/... (a set of one kind would only repeat eval/...).
    """
    scored = [(score_clip(c, p), to_frames(c) == 1) for c, p in zip(clips, captions) if parse_caption(p) is not None]
    out = _means([s for s, _ in scored], "eval/")
    out["eval/num_skipped"] = float(len(clips) - len(scored))
    if 0 < sum(still for _, still in scored) < len(scored):
        out.update(_means([s for s, still in scored if still], "eval/image/"))
        out.update(_means([s for s, still in scored if not still], "eval/video/"))
    return out


def to_frames(clip: torch.Tensor | np.ndarray) -> int:
    """Frame count of a clip in either layout (see to_rgb)."""
    return int(clip.shape[0] if clip.dtype in (np.uint8, torch.uint8) else clip.shape[1])


def _means(scores: list[dict[str, float]], prefix: str) -> dict[str, float]:
    keys = [k for k in FIGURES if any(k in s for s in scores)]  # motion_ok: over the clips that have it
    out = {prefix + k: float(np.mean([s[k] for s in scores if k in s])) for k in keys}
    out[prefix + "num_clips"] = float(len(scores))
    return out


def reference_scores(manifest_dir: str | Path) -> dict[str, float]:
    """score_clips over the real clips of a set (its manifest.jsonl; videos decoded with decord,
    still images with Pillow, see video_io.read_frames): the figures a perfect generator would
    reach, H.264 artefacts included."""
    root = Path(manifest_dir)
    clips, captions = [], []
    for line in (root / "manifest.jsonl").read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            info = probe(str(root / item["path"]))
            clips.append(read_frames(str(root / item["path"]), list(range(info.frames)), info))
            captions.append(item["caption"])
    return score_clips(clips, captions)


# -- first-frame consistency of conditioned clips (cond.kind, docs/conditioning.md) -------------

# the keys of score_given, in order
GIVEN_FIGURES = ("kept_background", "kept_color", "kept_shape", "kept_ok", "motion_after_ok")


@dataclass
class _Look:
    """What a run of frames shows: background and shape colour (palette indices), whether that
    colour forms a real shape (color_ok's conditions), the shape's kind and how often it shows."""
    bg: int
    background: bool  # the background colour covers >= BACKGROUND_MIN_SHARE of the pixels
    shape: int
    colored: bool
    square: bool
    seen: float
    blobs: _Blobs
    palette_share: float  # share of pixels near some palette colour
    dims: tuple[int, int, int]  # (F, H, W)


def _look(rgb: np.ndarray) -> _Look:
    """score_clip's colour, shape and background statistics of rgb [F, H, W, 3], without a caption."""
    F, H, W, _ = rgb.shape
    labels = palette_labels(rgb)
    counts = np.bincount(labels[labels >= 0], minlength=len(PALETTE))
    bg = int(counts.argmax())
    shape_counts = np.where(np.arange(NUM_SHAPE_COLORS) == bg, 0, counts[:NUM_SHAPE_COLORS])
    shape = int(np.where(np.arange(NUM_SHAPE_COLORS) == bg, -1, shape_counts).argmax())  # never bg, even with no counts
    blobs = _blobs(rgb, labels, bg, shape)
    seen = blobs.size > 0
    colored = bool(counts[shape] >= COLOR_MIN_SHARE * shape_counts.sum()
                   and counts[shape] >= BLOB_MIN_AREA * min(H, W) ** 2 * F and blobs.exact >= 0.5 * counts[shape])
    square = bool(seen.any() and np.median(blobs.fill[seen]) >= FILL_SPLIT)
    return _Look(bg, bool(counts[bg] >= BACKGROUND_MIN_SHARE * labels.size), shape, colored, square,
                 float(seen.mean()), blobs, float((labels >= 0).mean()), (F, H, W))


def score_given(clip: torch.Tensor | np.ndarray, given_frames: np.ndarray, caption: str | ShapeCaption,
                given: torch.Tensor | np.ndarray | None = None) -> dict[str, float]:
    """First-frame consistency of a clip generated from given frames (image-to-video): figures in
    [0, 1] comparing the generated frames (those not in the bool mask `given_frames` [F]) with
    the given ones (taken from `given`, the clip that was given, or else from `clip` itself).

    kept_background  the generated frames' background is the given frames' (and covers half).
    kept_color       their shape colour is the given frames' and forms a shape (color_ok's tests).
    kept_shape       half the generated frames or more show the blob, of the given frames' kind.
    kept_ok          all three.
    motion_after_ok  motion_ok on the continuation alone: from the last given frame before the
                     first generated one, over the generated frames (the given frames' own motion
                     does not count); only where motion is scored and two such frames exist.
    """
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    if cap is None:
        raise ValueError(f"not a caption of the shapes world: {caption!r}")
    rgb = to_rgb(clip)
    ref = to_rgb(given) if given is not None else rgb
    mask = np.asarray(given_frames, bool)
    if not mask.any() or mask.all():
        raise ValueError("score_given needs both given and generated frames")
    before, after = _look(ref[mask]), _look(rgb[~mask])
    out = {
        "kept_background": float(after.bg == before.bg and after.background),
        "kept_color": float(after.shape == before.shape and after.colored),
        "kept_shape": float(after.seen >= 0.5 and after.square == before.square),
    }
    out["kept_ok"] = float(all(out.values()))
    first = int(np.flatnonzero(~mask)[0])
    cont = rgb[max(0, first - 1):] if first > 0 else rgb
    if cap.has_motion and len(cont) >= 2:
        F, H, W, _ = cont.shape
        look = _look(cont)
        out["motion_after_ok"] = float(look.bg == before.bg and look.shape == before.shape
                                       and _motion_ok(look.blobs, cap, H, W))
    return out


def score_given_clips(clips: list, masks: list[np.ndarray], captions: list[str],
                      givens: list | None = None) -> dict[str, float]:
    """Means of `score_given` over the conditioned clips whose caption is of this world, keys
    prefixed eval/ (motion_after_ok over the clips where it is scored); eval/num_given counts them."""
    givens = givens or [None] * len(clips)
    scored = [score_given(c, m, p, g) for c, m, p, g in zip(clips, masks, captions, givens)
              if parse_caption(p) is not None and m.any() and not m.all()]
    out = {}
    for k in GIVEN_FIGURES:
        values = [s[k] for s in scored if k in s]
        if values:
            out[f"eval/{k}"] = float(np.mean(values))
    out["eval/num_given"] = float(len(scored))
    return out
