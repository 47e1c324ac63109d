"""Drift of a long clip of the embedded shapes world: the exact metric on each window.

A block-causal run streams clips far past its training length (tools.sample --frames 32
--overlap-frames 4, docs/causal.md). Whether it drifts is a per-window question: cut the clip
into windows of WINDOW frames (the world's training size) and read each window as
shapes_metric reads a clip — the same palette, blob and fill statistics (`_look`), so a window
of a rendered clip scores exactly as a rendered 8-frame clip does.

Per window k (0-based; window k holds frames k·WINDOW .. (k+1)·WINDOW − 1):

    background_ok, color_ok, shape_ok, single_shape   score_clip's figures against the caption
    moving_ok   the shape still moves: its blob shows in half the window's frames or more and
                its median speed between consecutive shown frames is >= MIN_SPEED px/frame (the
                caption's direction words state the start only: after a bounce either sign is
                right, so later windows check motion, not its direction)
    all_ok      background, colour, shape and moving
    kept        the window shows a background and a coloured shape (background_ok's and
                color_ok's tests, the blob in half the frames) and they are window 0's:
                background colour, shape colour and kind equal — drift without the caption
    motion_ok   window 0 only: score_clip's direction check against the caption
"""
from __future__ import annotations

import numpy as np
import torch

# the metric's own reading of the pixels (not a copy of it), so a window scores as a clip does
from dit_train.data_pipelines.shapes_metric import MIN_SPEED, _caption, _Look, _look, _scores, to_rgb
from dit_train.data_pipelines.synthetic_video import EVAL_SIZE

WINDOW = EVAL_SIZE[0]  # frames per scored window: the size the world's clips are sampled and scored at
# the keys of score_windows, in order (motion_ok in window 0 only)
WINDOW_FIGURES = ("background_ok", "color_ok", "shape_ok", "single_shape", "moving_ok", "all_ok", "kept", "motion_ok")


def _moving(look: _Look) -> bool:
    """The blob shows in half the frames or more and its median speed is >= MIN_SPEED px/frame."""
    have = np.flatnonzero(look.blobs.size > 0)
    if len(have) < 2 or len(have) < 0.5 * look.dims[0]:
        return False
    steps = np.diff(look.blobs.center[have], axis=0) / np.diff(have)[:, None]  # [k, 2] px/frame
    return bool(np.median(np.hypot(steps[:, 0], steps[:, 1])) >= MIN_SPEED)


def _shows(look: _Look) -> bool:
    return bool(look.background and look.colored and look.seen >= 0.5)


def score_windows(clip: torch.Tensor | np.ndarray, caption: str, window: int = WINDOW) -> list[dict[str, float]]:
    """One dict of figures in {0, 1} per window of the clip (uint8 [F, H, W, 3] or float
    [3, F, H, W] in [-1, 1]; F a multiple of `window`), keys WINDOW_FIGURES (module docstring)."""
    cap, rgb = _caption(caption), to_rgb(clip)
    F = rgb.shape[0]
    if F % window or F < window:
        raise ValueError(f"a clip of {F} frames is not a whole number of {window}-frame windows")
    out, first = [], None
    for k in range(F // window):
        look = _look(rgb[k * window:(k + 1) * window])
        first = look if first is None else first
        figures = _scores(look, cap)
        row = {key: figures[key] for key in ("background_ok", "color_ok", "shape_ok", "single_shape")}
        row["moving_ok"] = float(_moving(look))
        row["all_ok"] = float(row["background_ok"] and row["color_ok"] and row["shape_ok"] and row["moving_ok"])
        row["kept"] = float(_shows(look) and look.bg == first.bg and look.shape == first.shape
                            and look.square == first.square)
        if k == 0 and "motion_ok" in figures:
            row["motion_ok"] = figures["motion_ok"]
        out.append(row)
    return out


def window_means(per_clip: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per window, the mean of each figure over the clips (motion_ok where scored), and
    num_clips: [{figure: mean}] in window order; every clip must have the same windows."""
    if not per_clip or len({len(c) for c in per_clip}) != 1:
        raise ValueError("window_means needs clips of one length (the same windows)")
    rows = []
    for k in range(len(per_clip[0])):
        scores = [c[k] for c in per_clip]
        row = {key: float(np.mean([s[key] for s in scores if key in s]))
               for key in WINDOW_FIGURES if any(key in s for s in scores)}
        row["num_clips"] = float(len(scores))
        rows.append(row)
    return rows
