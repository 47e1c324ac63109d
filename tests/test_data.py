"""Embedded video data (written with PyAV, read with decord) and packing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dit_train.data_pipelines.packing import balanced_split, pack_ffd, plan_step, step_samples
from dit_train.data_pipelines.synthetic_video import dataset_dir, ensure_synthetic_videos, write_mp4
from dit_train.data_pipelines.video_dataset import VideoClipDataset
from dit_train.data_pipelines.video_io import VideoInfo, frame_indices, probe, read_frames


def test_generator_writes_clips_that_decord_reads_back(tiny_cfg):
    c = tiny_cfg.data
    d = dataset_dir(c.cache_dir, c.num_clips, c.gen_seed, c.num_images, c.widths, c.heights, c.frames,
                      c.heldout_compositions)
    rows = [json.loads(line) for line in (d / "manifest.jsonl").read_text().splitlines()]
    assert len(rows) == c.num_clips
    sizes = {(r["frames"], r["height"], r["width"]) for r in rows}
    # varied on purpose (the loss weighting only matters when samples differ): every configured
    # size shows up, and several lengths
    assert len({r["frames"] for r in rows}) > 3, sizes
    hw = {(r["height"], r["width"]) for r in rows}
    assert len(hw) > 3 and hw <= {(h, w) for h in c.heights for w in c.widths}, sizes
    assert all(c.frames[0] <= r["frames"] <= c.frames[1] for r in rows), sizes
    for r in rows[:6]:
        info = probe(str(d / r["path"]))
        assert (info.frames, info.height, info.width) == (r["frames"], r["height"], r["width"])
        frames = read_frames(str(d / r["path"]), list(range(info.frames)), info)
        assert frames.shape == (r["frames"], r["height"], r["width"], 3) and frames.dtype == torch.uint8
        assert r["caption"].startswith("a ")


def test_generation_is_deterministic(tmp_path, tiny_cfg):
    a = ensure_synthetic_videos(tmp_path / "a", 3, 7)
    b = ensure_synthetic_videos(tmp_path / "b", 3, 7)
    assert (a / "manifest.jsonl").read_text() == (b / "manifest.jsonl").read_text()
    ia = probe(str(a / "clip_0001.mp4"))
    fa = read_frames(str(a / "clip_0001.mp4"), [0, 1], ia)
    fb = read_frames(str(b / "clip_0001.mp4"), [0, 1], ia)
    assert torch.equal(fa, fb)


def test_decord_odd_width_workaround(tmp_path):
    """decord 0.6 garbles width 48; read_frames must still return the right shape and content."""
    frames = torch.zeros(4, 32, 48, 3, dtype=torch.uint8)
    frames[:, :, 20:28, 0] = 255  # a red bar at x = 20..27
    write_mp4(tmp_path / "w48.mp4", frames.numpy())
    info = probe(str(tmp_path / "w48.mp4"))
    assert (info.height, info.width) == (32, 48)
    out = read_frames(str(tmp_path / "w48.mp4"), [0, 2], info)
    assert out.shape == (2, 32, 48, 3)
    red = out[0, 16, :, 0].float()
    assert red[21:27].min() > 150 and red[:15].max() < 80 and red[33:].max() < 80


def test_frame_sampling_by_stride_and_fps():
    assert frame_indices(20, 8.0, 0.0, 2, 16, 1) == list(range(0, 20, 2))
    assert frame_indices(20, 8.0, 0.0, 1, 6, 4) == [0, 1, 2, 3]  # max 6, multiple of 4
    assert frame_indices(16, 16.0, 8.0, 1, 100, 1) == list(range(0, 16, 2))  # 16 fps -> 8 fps
    assert frame_indices(3, 8.0, 0.0, 1, 16, 4) == []  # shorter than one temporal patch


def test_dataset_token_counts_match_decoded_samples(tiny_cfg):
    from dit_train.data_pipelines import open_dataset

    ds = open_dataset(tiny_cfg.data, tiny_cfg.model)
    pt, ph, pw = tiny_cfg.model.patch_size
    for i in range(4):
        x = ds[i].pixels
        c, f, h, w = x.shape
        assert c == 3 and f % pt == 0 and h % ph == 0 and w % pw == 0
        assert ds.num_tokens(i) == f // pt * (h // ph) * (w // pw)
        assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert len(set(ds.lengths())) > 3  # uneven on purpose


def test_unusable_clips_are_skipped_and_counted(tmp_path):
    entries = [
        __import__("dit_train.data_pipelines.video_dataset", fromlist=["ClipEntry"]).ClipEntry("ok.mp4", "", VideoInfo(8, 32, 32, 8)),
        __import__("dit_train.data_pipelines.video_dataset", fromlist=["ClipEntry"]).ClipEntry("short.mp4", "", VideoInfo(1, 32, 32, 8)),
    ]
    ds = VideoClipDataset(entries, patch=(2, 8, 8))
    assert len(ds) == 1 and ds.skipped[0][0] == "short.mp4"


@pytest.mark.parametrize("budget", [300, 700, 5000])
def test_ffd_respects_budget_and_loses_nothing(budget):
    g = torch.Generator().manual_seed(0)
    lengths = {i: int(x) for i, x in enumerate(torch.randint(1, 300, (60,), generator=g))}
    bins = pack_ffd(list(lengths), lengths, budget)
    assert sorted(i for b in bins for i in b) == sorted(lengths)
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)


def test_sample_larger_than_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_ffd([0], {0: 10}, 5)


def test_step_samples_do_not_depend_on_layout():
    lengths = {i: 10 + (i * 37) % 200 for i in range(40)}
    for step in range(12):
        sets = []
        for dp, ga, budget in [(1, 1, 10_000), (2, 1, 300), (4, 3, 250), (3, 2, 400)]:
            plan = plan_step(step, lengths, 8, dp, ga, budget, seed=3)
            got = sorted(i for rank in plan.micro_batches for mb in rank for i in mb)
            assert len({len(r) for r in plan.micro_batches}) == 1  # same micro-batch count per rank
            most = max(sum(len(mb) for mb in r) for r in plan.micro_batches)
            assert len(plan.micro_batches[0]) >= min(ga, most)  # at least one micro-batch per non-empty group
            sets.append(got)
        assert all(s == sets[0] for s in sets)
        assert len(set(sets[0])) == 8  # no sample twice in a step


def test_epochs_cover_dataset_and_differ():
    ids = [i for s in range(5) for i in step_samples(s, 10, 2, seed=0)]
    assert sorted(ids) == list(range(10))
    assert step_samples(0, 10, 2, 0) != step_samples(5, 10, 2, 0) or step_samples(1, 10, 2, 0) != step_samples(6, 10, 2, 0)


def test_balanced_split_balances_tokens():
    lengths = {i: 100 - i for i in range(20)}
    groups = balanced_split(list(lengths), lengths, 4)
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lengths.values())


def test_generator_sizes_are_config_keys(tmp_path):
    """data.widths / heights / frames choose the clip sizes; the default sizes keep the old cache dir."""
    from dit_train.data_pipelines.synthetic_video import FRAMES, HEIGHTS, WIDTHS

    assert dataset_dir(tmp_path, 4, 3).name == "synthetic_video_v2_n4_seed3"
    assert dataset_dir(tmp_path, 4, 3, 0, WIDTHS, HEIGHTS, FRAMES) == dataset_dir(tmp_path, 4, 3)
    d = ensure_synthetic_videos(tmp_path, 4, 3, widths=[64], heights=[24, 40], frames=[3, 5])
    assert d != dataset_dir(tmp_path, 4, 3)
    rows = [json.loads(line) for line in (d / "manifest.jsonl").read_text().splitlines()]
    assert all(r["width"] == 64 and r["height"] in (24, 40) and 3 <= r["frames"] <= 5 for r in rows), rows
    with pytest.raises(ValueError, match="multiples of 32"):
        dataset_dir(tmp_path, 4, 3, widths=[48], heights=[24], frames=[4, 8])


def test_heldout_compositions_are_in_no_clip_and_captions_stay_true(tmp_path):
    """data.heldout_compositions: the clips cycle through the 208 training compositions and
    never show one of the 48 that tools.evaluate --heldout scores; each clip still moves the way
    its caption says (the direction is folded into the composition's quadrant)."""
    from dit_train.data_pipelines.shapes_metric import score_clip
    from dit_train.data_pipelines.synthetic_video import caption_split

    d = ensure_synthetic_videos(tmp_path, 216, 5, widths=[32], heights=[32], frames=[8, 8], heldout_compositions=True)
    rows = [json.loads(line) for line in (d / "manifest.jsonl").read_text().splitlines()]
    train, held = caption_split()
    captions = [r["caption"] for r in rows]
    assert not set(captions) & set(held)
    assert set(captions) == set(train)  # 216 >= 208 clips: every training composition, once or twice
    assert d != dataset_dir(tmp_path, 216, 5, 0, [32], [32], [8, 8])  # never taken for a set of all 256
    for r in rows[:12]:
        info = probe(str(d / r["path"]))
        clip = read_frames(str(d / r["path"]), list(range(info.frames)), info).permute(3, 0, 1, 2).float() / 127.5 - 1
        assert score_clip(clip, r["caption"])["all_ok"] == 1.0, r["caption"]
