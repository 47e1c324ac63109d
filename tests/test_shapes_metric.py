"""The shapes-world metric: real clips score at the top, noise at zero, and each wrong caption
statement fails its own figure only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_train.data_pipelines.shapes_metric import (FIGURES, ShapeCaption, components, parse_caption, reference_scores,
                                          score_clip, score_clips)
from dit_train.data_pipelines.synthetic_video import BACKGROUNDS, COLORS, _render, ensure_synthetic_videos, write_mp4
from dit_train.data_pipelines.video_io import probe, read_frames, to_model_range

SEED = 1234  # the default set's gen_seed: the first clips below are the clips training sees
FLIP = {"up": "down", "down": "up", "left": "right", "right": "left"}


def _clip(i: int, seed: int = SEED) -> tuple[np.ndarray, str]:
    return _render(np.random.default_rng([seed, i]))


def _with(caption: str, **words: str) -> str:
    """The caption with some statements replaced (color=, shape=, vertical=, horizontal=, background=)."""
    c = parse_caption(caption)
    d = {**c.__dict__, **words}
    motion = f" moving {d['vertical']} and {d['horizontal']}" if d["vertical"] else ""
    return f"a {d['color']} {d['shape']}{motion} on a {d['background']} background"


def _scene(shapes: list[tuple], bg: str = "navy", frames: int = 8, height: int = 64, width: int = 96) -> np.ndarray:
    """uint8 [F, H, W, 3] drawn like _render, without walls: shapes are (kind, colour, x, y, vx, vy, r)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((frames, height, width, 3), np.uint8)
    out[:] = BACKGROUNDS[bg]
    for kind, color, x, y, vx, vy, r in shapes:
        for f in range(frames):
            cx, cy = x + f * vx, y + f * vy
            inside = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r if kind == "circle" else (
                (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r))
            out[f][inside] = COLORS[color]
    return out


def _mp4(tmp_path, frames: np.ndarray) -> torch.Tensor:
    path = tmp_path / "clip.mp4"
    write_mp4(path, frames)
    info = probe(str(path))
    return read_frames(str(path), list(range(info.frames)), info)


def test_parse_caption():
    assert parse_caption("a red circle moving up and left on a navy background") == ShapeCaption(
        "red", "circle", "up", "left", "navy")
    still = parse_caption("A white square on a gray background.")
    assert still == ShapeCaption("white", "square", None, None, "gray") and not still.has_motion
    for other in ("a red triangle on a navy background", "a pink circle on a navy background",
                  "a red circle on a pink background", "a red circle moving up on a navy background",
                  "two red circles on a navy background", "the quick brown fox", ""):
        assert parse_caption(other) is None, other


def test_components_are_8_connected_per_frame():
    m = np.zeros((2, 5, 6), bool)
    m[0, 0, 0] = m[0, 1, 1] = True  # diagonal neighbours: one component
    m[0, 3:5, 3:6] = True
    m[1, 0, 0] = True  # same place, next frame: its own component
    lab = components(m)
    assert lab[0, 0, 0] == lab[0, 1, 1] != lab[0, 4, 5] and lab[1, 0, 0] not in (lab[0, 0, 0], -1)
    assert len(np.unique(lab[lab >= 0])) == 3 and (lab[~m] == -1).all()
    snake = np.zeros((1, 9, 9), bool)  # a long thin winding path is one component
    snake[0, ::2, :] = True
    snake[0, 1::4, -1] = snake[0, 3::4, 0] = True
    assert len(np.unique(components(snake)[snake])) == 1


def test_real_clips_score_at_the_top():
    # Rendered frames are exact: measured 1.0 on every figure for these 48 (and 800 other seeds).
    clips, captions = zip(*(_clip(i) for i in range(48)))
    scores = [score_clip(c, p) for c, p in zip(clips, captions)]
    assert all(s["palette_share"] == 1.0 and s["all_ok"] == 1.0 and s["single_shape"] == 1.0 for s in scores)
    assert all("motion_ok" in s for s in scores)
    # the model's layout ([3, F, H, W] in [-1, 1]) reads the same pixels, in bf16 too
    x = to_model_range(torch.from_numpy(clips[0]))
    assert score_clip(x, captions[0]) == scores[0]
    assert score_clip(x.bfloat16(), captions[0])["all_ok"] == 1.0


def test_h264_round_trip_keeps_real_clips_at_the_top(tmp_path):
    # H.264 (crf 12, 4:2:0) moves edge pixels off the palette: measured palette_share 0.93-1.0,
    # every other figure 1.0 (also over 1000 other decoded clips).
    for i in range(6):
        frames, caption = _clip(i)
        s = score_clip(_mp4(tmp_path, frames), caption)
        assert s["palette_share"] >= 0.9 and s["all_ok"] == s["single_shape"] == s["motion_ok"] == 1.0, (caption, s)


def test_reference_scores_of_a_written_set(data_cache):
    # 16 clips of the default seed (the tiny config's set). Measured: palette_share 0.978, the rest 1.0.
    ref = reference_scores(ensure_synthetic_videos(data_cache, 16, SEED))
    assert ref["eval/num_clips"] == 16 and ref["eval/palette_share"] >= 0.95
    assert all(ref[f"eval/{k}"] == 1.0 for k in FIGURES if k != "palette_share"), ref


@pytest.mark.parametrize("kind", ["gaussian", "uniform", "uniform_uint8"])
def test_noise_scores_zero(kind):
    # Measured over 48 clips each: palette_share 0.036 (Gaussian, uniform), every other figure 0.
    g = torch.Generator().manual_seed(0)
    clips, captions = [], []
    for i in range(16):
        frames, caption = _clip(i)
        F, H, W, _ = frames.shape
        # every colour and background word twice or more: clamped Gaussian noise piles up at
        # white and black, uniform noise is nearest to the mid colours
        caption = _with(caption, color=list(COLORS)[i % 8], background=list(BACKGROUNDS)[i % 4])
        clips.append({"gaussian": lambda: torch.randn(3, F, H, W, generator=g),
                      "uniform": lambda: torch.rand(3, F, H, W, generator=g) * 2 - 1,
                      "uniform_uint8": lambda: torch.randint(0, 256, (F, H, W, 3), generator=g, dtype=torch.uint8)}[kind]())
        captions.append(caption)
    s = score_clips(clips, captions)
    assert s["eval/palette_share"] <= 0.1, s
    assert all(s[f"eval/{k}"] == 0.0 for k in FIGURES if k != "palette_share"), s


def test_flat_gray_scores_zero():
    # an untrained model's output: all zeros = RGB 127.5, near no palette colour
    s = score_clip(torch.zeros(3, 6, 32, 64), "a red circle moving up and left on a gray background")
    assert all(v == 0.0 for v in s.values()), s


def test_each_wrong_statement_fails_its_own_figure(tmp_path):
    for i in range(12):
        frames, caption = _clip(i)
        clip = _mp4(tmp_path, frames) if i < 3 else frames  # a few through H.264 too
        cap = parse_caption(caption)
        wrong = {
            "background_ok": _with(caption, background=next(b for b in BACKGROUNDS if b != cap.background)),
            "color_ok": _with(caption, color=next(c for c in COLORS if c != cap.color)),
            "shape_ok": _with(caption, shape="square" if cap.shape == "circle" else "circle"),
            "motion_ok": _with(caption, vertical=FLIP[cap.vertical], horizontal=FLIP[cap.horizontal]),
        }
        for figure, bad in wrong.items():
            s = score_clip(clip, bad)
            assert s[figure] == 0.0 and s["all_ok"] == 0.0, (caption, bad, s)
            assert all(v == 1.0 for k, v in s.items() if k not in (figure, "all_ok", "palette_share")), (bad, s)


def test_motion_words_one_at_a_time():
    # A red square crossing the middle of a 96x64 frame, 2 px/frame right and 1.5 px/frame up.
    clip = _scene([("square", "red", 30, 40, 2.0, -1.5, 6)])
    assert score_clip(clip, "a red square moving up and right on a navy background")["motion_ok"] == 1.0
    for words in ("down and right", "up and left", "down and left"):
        assert score_clip(clip, f"a red square moving {words} on a navy background")["motion_ok"] == 0.0, words
    # a purely horizontal motion says nothing about up/down: either word passes
    flat = _scene([("square", "red", 30, 32, 2.0, 0.0, 6)])
    assert all(score_clip(flat, f"a red square moving {v} and right on a navy background")["motion_ok"] == 1.0
               for v in ("up", "down"))


def test_slow_axis_is_judged_over_several_steps():
    # 0.4 px/frame right: the rasterized square steps 1 px every 2-3 frames and not at all in
    # some steps; the mean over the first steps still shows the sign
    clip = _scene([("square", "red", 30.7, 40, 0.4, -1.5, 6)])
    assert score_clip(clip, "a red square moving up and right on a navy background")["motion_ok"] == 1.0
    assert score_clip(clip, "a red square moving up and left on a navy background")["motion_ok"] == 0.0


def test_blurred_shapes_keep_their_kind():
    # A blurry sample still shows its shape: the fill ratio reads soft coverage, which blur only
    # spreads. Measured on the 48 default clips at sigma 1.5: every figure but palette_share 1.0.
    k = torch.exp(-torch.arange(-3, 4.0) ** 2 / (2 * 1.5 ** 2))
    k = (k[:, None] * k[None, :] / k.sum() ** 2)[None, None]
    for i in range(12):
        frames, caption = _clip(i)
        x = to_model_range(torch.from_numpy(frames))  # [3, F, H, W]
        y = torch.nn.functional.conv2d(torch.nn.functional.pad(x.transpose(0, 1).reshape(-1, 1, *x.shape[2:]),
                                                                (3, 3, 3, 3), mode="replicate"), k)
        s = score_clip(y.reshape(x.shape[1], 3, *x.shape[2:]).transpose(0, 1), caption)
        assert all(v == 1.0 for k_, v in s.items() if k_ != "palette_share"), (caption, s)


def test_caption_direction_is_the_start_and_survives_cutting():
    # The caption states the direction at the start. A square that hits the right wall
    # halfway and comes back is still "moving ... right"; "left" fails.
    clip = _scene([("square", "green", 60, 32, 4.0, 0.0, 6)], bg="black", frames=10, width=96)
    bounce = np.concatenate([clip[:7], clip[5:2:-1]])  # reaches the wall, then moves back
    assert score_clip(bounce, "a green square moving up and right on a black background")["motion_ok"] == 1.0
    assert score_clip(bounce, "a green square moving up and left on a black background")["motion_ok"] == 0.0
    # a shape starting against the wall it moves to bounces at once: either word passes
    at_wall = _scene([("square", "green", 89.5, 32, -2.0, 0.0, 6)], bg="black", frames=6, width=96)
    assert score_clip(at_wall, "a green square moving up and right on a black background")["motion_ok"] == 1.0
    # training cuts clips to their first data.max_frames frames: what the caption says must
    # still be shown (real clips, cut to 3..8 frames)
    for i in range(24):
        frames, caption = _clip(i)
        for keep in (3, 5, 8):
            assert score_clip(frames[:keep], caption)["motion_ok"] == 1.0, (i, keep, caption)


def test_broken_clips():
    frames, caption = _clip(3)
    empty = np.broadcast_to(frames[:, :1, :1], frames.shape).copy()  # only the background left
    s = score_clip(empty, caption)
    assert s["background_ok"] == 1.0 and s["color_ok"] == s["shape_ok"] == s["single_shape"] == s["motion_ok"] == 0.0
    static = np.repeat(frames[:1], len(frames), axis=0)  # the shape stands still
    s = score_clip(static, caption)
    assert s["motion_ok"] == 0.0 and s["color_ok"] == s["shape_ok"] == s["single_shape"] == 1.0, s
    two = _scene([("circle", "yellow", 20, 20, 1.5, 1.0, 7), ("circle", "yellow", 70, 40, -1.5, 1.0, 7)])
    s = score_clip(two, "a yellow circle moving down and left on a navy background")
    assert s["single_shape"] == 0.0 and s["color_ok"] == s["shape_ok"] == 1.0, s
    growing = np.concatenate([_scene([("circle", "yellow", 40, 30, 1.0, 1.0, r)], frames=1) for r in range(4, 20, 2)])
    assert score_clip(growing, "a yellow circle moving down and right on a navy background")["single_shape"] == 0.0
    flicker = _scene([("circle", "yellow", 20, 20, 1.5, 1.0, 7)])
    flicker[1::2] = BACKGROUNDS["navy"]  # the shape is there every other frame only
    assert score_clip(flicker, "a yellow circle moving down and right on a navy background")["single_shape"] == 0.0


def test_color_must_be_the_majority():
    # three squares of about the same size: red is the largest but not most of the coloured pixels
    clip = _scene([("square", "red", 20, 20, 1, 1, 7), ("square", "green", 50, 20, 1, 1, 6),
                   ("square", "blue", 70, 45, -1, -1, 6)])
    s = score_clip(clip, "a red square moving down and right on a navy background")
    assert s["color_ok"] == 0.0 and s["background_ok"] == 1.0, s
    one = _scene([("square", "red", 20, 20, 1, 1, 7)])
    assert score_clip(one, "a red square moving down and right on a navy background")["color_ok"] == 1.0


def test_out_of_range_values_are_clamped():
    frames, caption = _clip(5)
    x = to_model_range(torch.from_numpy(frames))
    x = torch.where(x < -0.5, x - 3.0, x + 3.0 * (x > 0.9))  # overshoot both ways
    assert score_clip(x, caption) == score_clip(x.clamp(-1, 1), caption)


def test_score_clips_means_splits_and_skips():
    videos = [_clip(i) for i in range(4)]
    stills = [(f[:1], _with(c, vertical=None, horizontal=None)) for f, c in (_clip(i) for i in range(4, 7))]
    s = score_clips([c for c, _ in videos], [p for _, p in videos])
    assert s["eval/num_clips"] == 4 and s["eval/num_skipped"] == 0 and s["eval/all_ok"] == 1.0
    assert not any(k.startswith(("eval/image/", "eval/video/")) for k in s)  # one kind: no split
    still_scores = score_clip(*stills[0])
    assert "motion_ok" not in still_scores and still_scores["all_ok"] == 1.0
    broken = [(np.zeros_like(videos[0][0]), videos[0][1])]  # black frames: fails (motion too)
    mixed = videos + stills + broken + [(videos[1][0], "something else entirely")]
    s = score_clips([c for c, _ in mixed], [p for _, p in mixed])
    assert s["eval/num_clips"] == 8 and s["eval/num_skipped"] == 1
    assert s["eval/image/num_clips"] == 3 and s["eval/video/num_clips"] == 5
    assert s["eval/motion_ok"] == s["eval/video/motion_ok"] == 4 / 5 and "eval/image/motion_ok" not in s
    assert s["eval/all_ok"] == 7 / 8 and s["eval/image/all_ok"] == 1.0
    with pytest.raises(ValueError):
        score_clip(videos[0][0], "a red circle")


def _components_by_search(mask: np.ndarray) -> np.ndarray:
    """The reference: breadth-first search from each unlabelled pixel, in flat-index order, so
    each component gets its smallest flat index (what `components` promises)."""
    F, H, W = mask.shape
    out = np.full(mask.shape, -1, np.int64)
    for f, y, x in zip(*np.nonzero(mask)):
        if out[f, y, x] >= 0:
            continue
        label, todo = np.ravel_multi_index((f, y, x), mask.shape), [(y, x)]
        out[f, y, x] = label
        while todo:
            cy, cx = todo.pop()
            for ny in range(max(cy - 1, 0), min(cy + 2, H)):
                for nx in range(max(cx - 1, 0), min(cx + 2, W)):
                    if mask[f, ny, nx] and out[f, ny, nx] < 0:
                        out[f, ny, nx] = label
                        todo.append((ny, nx))
    return out


def test_components_match_a_breadth_first_search():
    rng = np.random.default_rng(0)
    for _ in range(60):  # densities from specks to noise's long chains to nearly full frames
        mask = rng.random((int(rng.integers(1, 4)), int(rng.integers(1, 24)), int(rng.integers(1, 24)))) < rng.random()
        assert np.array_equal(components(mask), _components_by_search(mask))


# -- first-frame consistency of conditioned clips --------------------------------------------------

def test_given_frames_consistency_scores_each_change_on_its_own():
    """score_given compares the generated frames with the given ones: the real continuation
    keeps everything; another colour, kind or background after the given frames fails its own
    figure; a shape that stops after the given frames fails motion_after_ok only."""
    from dit_train.data_pipelines.shapes_metric import GIVEN_FIGURES, score_given

    given = np.zeros(8, bool)
    given[:2] = True
    cap = "a red circle moving down and right on a navy background"
    real = _scene([("circle", "red", 20, 16, 2, 1.5, 9)])
    assert score_given(real, given, cap) == {k: 1.0 for k in GIVEN_FIGURES}

    def after(**change) -> dict:
        kind, color, bg = change.get("kind", "circle"), change.get("color", "red"), change.get("bg", "navy")
        moving = _scene([(kind, color, 20, 16, 2, 1.5, 9)], bg=bg)
        if change.get("stop"):
            moving = np.repeat(real[1:2], 8, axis=0)
        clip = real.copy()
        clip[2:] = moving[2:]
        return score_given(clip, given, cap)

    assert after(color="green") == {**{k: 1.0 for k in GIVEN_FIGURES}, "kept_color": 0.0, "kept_ok": 0.0,
                                    "motion_after_ok": 0.0}
    assert after(kind="square") == {**{k: 1.0 for k in GIVEN_FIGURES}, "kept_shape": 0.0, "kept_ok": 0.0}
    assert after(bg="olive")["kept_background"] == 0.0 and after(bg="olive")["kept_ok"] == 0.0
    assert after(stop=True) == {**{k: 1.0 for k in GIVEN_FIGURES}, "motion_after_ok": 0.0}
    with pytest.raises(ValueError, match="both given and generated"):
        score_given(real, np.ones(8, bool), cap)


def test_given_frames_of_the_decoded_set_keep_their_shape_real_or_frozen(data_cache):
    """On the embedded world's decoded clips (H.264 edges, discs of every size, first temporal
    patch of 2 frames given): the real continuation keeps everything, and a model that only froze
    the last given frame keeps background, colour and shape kind (kept_shape 1: the fill split
    separates real discs, fill <= 0.86, from real squares, >= 0.99) but fails motion_after_ok."""
    import json

    from dit_train.data_pipelines.shapes_metric import GIVEN_FIGURES, score_given

    root = ensure_synthetic_videos(data_cache, 16, SEED)
    rows = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    kinds = set()
    for r in rows:
        info = probe(str(root / r["path"]))
        real = read_frames(str(root / r["path"]), list(range(info.frames)), info).numpy()
        given = np.arange(len(real)) < 2
        frozen = np.concatenate([real[:2], np.repeat(real[1:2], len(real) - 2, axis=0)])
        assert score_given(real, given, r["caption"]) == {k: 1.0 for k in GIVEN_FIGURES}, r
        assert score_given(frozen, given, r["caption"]) == {**{k: 1.0 for k in GIVEN_FIGURES}, "motion_after_ok": 0.0}, r
        kinds.add(parse_caption(r["caption"]).shape)
    assert kinds == {"circle", "square"}


def test_shape_grade_moves_with_the_blob_between_a_disc_and_a_square():
    # shape_ok is a threshold: a rounded blob scores 0 on every square caption however near it
    # came. shape_grade (the RL reward's shape term) must move with the corners, within [0, 1].
    from dit_train.data_pipelines.shapes_metric import shape_grade
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32)

    def blob(cut: int) -> np.ndarray:
        """A red 15 x 15 square on navy with a corner triangle of legs `cut` px off each corner."""
        frames = np.empty((4, 32, 32, 3), np.uint8)
        frames[:] = BACKGROUNDS["navy"]
        for f in range(4):
            dx, dy = np.abs(xx - 10 - 2 * f), np.abs(yy - 14)
            frames[f][(dx <= 7) & (dy <= 7) & (dx + dy <= 14 - cut)] = COLORS["red"]
        return frames

    square, circle = "a red square moving down and right on a navy background", \
        "a red circle moving down and right on a navy background"
    cuts = (0, 2, 3, 4, 7)  # fill 1, 0.95, 0.89, 0.82, 0.63
    grades = [shape_grade(blob(c), square) for c in cuts]
    assert grades[0] == 1.0 and grades[-1] == 0.0, grades
    assert 1 > grades[1] > grades[2] > grades[3] > 0, grades  # in between, and rounder is lower
    for c in cuts:  # a circle caption reads the same scale reversed
        assert shape_grade(blob(c), circle) == pytest.approx(1 - shape_grade(blob(c), square))
    empty = np.empty((4, 32, 32, 3), np.uint8)
    empty[:] = BACKGROUNDS["navy"]
    assert shape_grade(empty, square) == 0.0 and shape_grade(empty, circle) == 0.0
