"""The drift measurement (docs/causal.md#the-drift-measurement): long rendered clips of the
embedded world, the exact metric per 8-frame window (data_pipelines/shapes_drift.py), and
tools.evaluate --frames 32 --overlap-frames 4 streaming a block-causal run's held-out captions
through tools.sample's own streaming path."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dit_train.data_pipelines.shapes_drift import WINDOW, score_windows, window_means
from dit_train.data_pipelines.synthetic_video import BACKGROUNDS, COLORS, caption_split, render_long_clip
from tests.conftest import bidirectional_copy

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


SAMPLER = ["--steps", "2", "--guidance", "2", "--seed", "3", "--no-stochastic"]


def test_drift_streams_through_tools_sample_and_scores_each_window(causal_run, tmp_path, capsys):
    """evaluate --frames 16 --overlap-frames 4 on 2 held-out captions: the clips are tools.sample's
    streamed ones, value for value; the JSON holds the figures of each window (the sampled clips
    and the rendered ceiling), the plot and the grid are written."""
    from dit_train.tools.evaluate import main
    from dit_train.tools.sample import main as sample

    out = tmp_path / "drift"
    assert main([str(causal_run), "--heldout", "--n", "2", "--frames", "16", "--overlap-frames", "4", *SAMPLER,
                 "--out", str(out)]) == 0
    assert "by 8-frame window: all_ok" in capsys.readouterr().out
    row = json.loads((out / "evaluate.json").read_text())
    drift = row["drift"]
    assert row["frames"] == 16 and row["overlap_frames"] == 4
    assert [w["frames"] for w in drift["windows"]] == ["1-8", "9-16"]
    assert all(w["num_clips"] == 2 and 0 <= w["all_ok"] <= 1 for w in drift["windows"])
    assert all(w["all_ok"] == 1 and w["kept"] == 1 for w in drift["reference_windows"])
    assert [c["caption"] for c in drift["clips"]] == HELD[:2]
    assert (out / "drift.png").stat().st_size > 0 and (out / "drift_grid.png").stat().st_size > 0
    assert json.loads((out / "info.json").read_text())["streamed"]
    same = tmp_path / "sample"
    assert sample([str(causal_run), "--prompt", HELD[0], "--prompt", HELD[1], "--frames", "16", "--overlap-frames",
                   "4", "--height", "32", "--width", "32", *SAMPLER, "--out", str(same)]) == 0
    got, want = load_file(str(out / "samples.safetensors")), load_file(str(same / "samples.safetensors"))
    assert sorted(got) == sorted(want) == ["prompt_0_0", "prompt_1_0"]
    assert all(got[k].shape == (3, 16, 32, 32) and torch.equal(got[k], want[k]) for k in got)
    # the asynchronous schedule across windows, through both tools
    assert main([str(causal_run), "--heldout", "--n", "1", "--frames", "16", "--overlap-frames", "4", "--ar-step", "1",
                 *SAMPLER, "--out", str(tmp_path / "async")]) == 0
    assert sample([str(causal_run), "--prompt", HELD[0], "--frames", "16", "--overlap-frames", "4", "--ar-step", "1",
                   "--height", "32", "--width", "32", *SAMPLER, "--out", str(tmp_path / "async_sample")]) == 0
    got, want = (load_file(str(tmp_path / d / "samples.safetensors"))["prompt_0_0"] for d in ("async", "async_sample"))
    assert torch.equal(got, want) and not torch.equal(got, load_file(str(out / "samples.safetensors"))["prompt_0_0"])


def test_drift_requests_that_cannot_run_are_refused_in_one_line(causal_run, tmp_path, capsys):
    """A bidirectional run, a length off the 8-frame windows or the blocks, past the length
    without an overlap, an overlap off the blocks, --train-captions, --overlap-frames alone:
    one `error:` line each, exit 2, nothing sampled."""
    from dit_train.tools.evaluate import main

    bidirectional = bidirectional_copy(causal_run, tmp_path / "bidirectional")
    capsys.readouterr()
    for run, extra, says in [(bidirectional, ["--frames", "32", "--overlap-frames", "4"], "is bidirectional"),
                             (causal_run, ["--frames", "20", "--overlap-frames", "4"], "8-frame windows"),
                             (causal_run, ["--frames", "32"], "give --overlap-frames"),
                             (causal_run, ["--frames", "32", "--overlap-frames", "2"], "multiple of model.causal_block"),
                             (causal_run, ["--frames", "32", "--overlap-frames", "8"], "less than"),
                             (causal_run, ["--train-captions", "--frames", "32", "--overlap-frames", "4"], "--train-captions"),
                             (causal_run, ["--overlap-frames", "4"], "give --frames")]:
        out = tmp_path / "o"
        assert main([str(run), *extra, "--n", "1", "--steps", "1", "--out", str(out)]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and says in err and "\n" not in err, (extra, err)
        assert not out.exists(), extra
