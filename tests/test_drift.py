"""The drift measurement (docs/causal.md#the-drift-measurement): long rendered clips of the
embedded world and the exact metric per 8-frame window (data_pipelines/shapes_drift.py)."""
from __future__ import annotations

import numpy as np
import pytest

from dit_train.data_pipelines.shapes_drift import WINDOW, score_windows, window_means
from dit_train.data_pipelines.synthetic_video import BACKGROUNDS, COLORS, caption_split, render_long_clip

HELD = caption_split()[1]


def test_rendered_long_clips_score_right_in_every_window():
    """32-frame rendered clips (several bounces at 32 x 32) score 1 on every figure of every
    window, at 32 x 32 and 48 x 64; the renderer is a pure function of its arguments."""
    for i, caption in enumerate(HELD[:6]):
        h, w = (32, 32) if i % 2 == 0 else (48, 64)
        clip = render_long_clip(caption, 32, h, w, index=i)
        assert clip.shape == (32, h, w, 3) and clip.dtype == np.uint8
        windows = score_windows(clip, caption)
        assert len(windows) == 32 // WINDOW
        assert all(v == 1.0 for row in windows for v in row.values()), (caption, windows)
        assert "motion_ok" in windows[0] and "motion_ok" not in windows[1]
    assert np.array_equal(render_long_clip(HELD[0], 32, index=3), render_long_clip(HELD[0], 32, index=3))
    assert not np.array_equal(render_long_clip(HELD[0], 32, index=3), render_long_clip(HELD[0], 32, index=4))
    with pytest.raises(ValueError, match="not a clip caption"):
        render_long_clip("a red circle on a navy background", 32)


def _recoloured(clip: np.ndarray, start: int, old: tuple, new: tuple) -> np.ndarray:
    out = clip.copy()
    hit = np.all(out[start:] == np.array(old, np.uint8), axis=-1)
    out[start:][hit] = new
    return out


def test_a_change_at_frame_17_is_flagged_from_window_3():
    """Frame 17 (index 16) opens window 3: a shape colour, a background or a stop from there on
    fails windows 3 and 4 only, each in its own figure; kept compares with window 1."""
    caption = HELD[0]
    color, background = caption.split()[1], caption.split()[-2]
    clip = render_long_clip(caption, 32, index=0)
    other = next(c for c in COLORS if c != color)
    windows = score_windows(_recoloured(clip, 16, COLORS[color], COLORS[other]), caption)
    assert [w["color_ok"] for w in windows] == [1, 1, 0, 0] and [w["kept"] for w in windows] == [1, 1, 0, 0]
    assert [w["all_ok"] for w in windows] == [1, 1, 0, 0] and all(w["background_ok"] for w in windows)
    other_bg = next(b for b in BACKGROUNDS if b != background)
    windows = score_windows(_recoloured(clip, 16, BACKGROUNDS[background], BACKGROUNDS[other_bg]), caption)
    assert [w["background_ok"] for w in windows] == [1, 1, 0, 0] and [w["kept"] for w in windows] == [1, 1, 0, 0]
    assert all(w["color_ok"] for w in windows)
    frozen = clip.copy()
    frozen[16:] = clip[16]  # the shape stops: still there, same colour and kind, no longer moving
    windows = score_windows(frozen, caption)
    assert [w["moving_ok"] for w in windows] == [1, 1, 0, 0] and all(w["kept"] for w in windows)
    assert all(w["color_ok"] and w["shape_ok"] for w in windows)
    means = window_means([score_windows(clip, caption), windows])
    assert [m["moving_ok"] for m in means] == [1, 1, 0.5, 0.5] and means[0]["num_clips"] == 2
    with pytest.raises(ValueError, match="whole number"):
        score_windows(clip[:30], caption)
