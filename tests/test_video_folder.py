"""data=video_folder: discovery, probing (with its index), corrupt files, background decoding."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dit_train.data_pipelines.packing import plan_step
from dit_train.data_pipelines.prefetch import Prefetcher
from dit_train.data_pipelines.synthetic_video import ensure_synthetic_videos
from dit_train.data_pipelines.video_dataset import VideoSample
from dit_train.data_pipelines.video_folder import index_clips, index_path, index_video_folder, list_clips
from dit_train.data_pipelines.video_io import VideoReadError
from tests.conftest import TINY_MODEL, compose_config, train_in_process


def make_video_folder(root: Path, src_cache: Path, n: int = 6) -> Path:
    """`n` generated clips in a folder tree with .txt captions (the last one has none), plus a
    corrupt .mp4 and a stray non-video file."""
    src = ensure_synthetic_videos(src_cache, n, 99)
    rows = [json.loads(line) for line in (src / "manifest.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        dst = root / ("nested/deeper" if i % 2 else ".") / f"video_{i}.mp4"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / r["path"], dst)
        if i < n - 1:
            dst.with_suffix(".txt").write_text(r["caption"] + "\n")
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    (root / "broken.txt").write_text("never read")
    (root / "notes.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_video_folder(tmp_path_factory.mktemp("videos"), tmp_path_factory.mktemp("src"))


def test_folder_listing_captions_and_corrupt_file_skipped(folder, tmp_path):
    clips = list_clips(folder)
    names = [Path(p).name for p, _ in clips]
    assert sorted(names) == sorted([f"video_{i}.mp4" for i in range(6)] + ["broken.mp4"])
    caps = {Path(p).name: c for p, c in clips}
    assert caps["video_0.mp4"].startswith("a ") and caps["video_5.mp4"] == ""
    index = index_video_folder(folder, tmp_path, workers=2, progress=False)
    assert len(index.entries) == 6 and index.uncaptioned == 1
    assert [Path(p).name for p, _ in index.skipped] == ["broken.mp4"]
    assert all(e.info.frames >= 4 and e.info.width in (32, 64, 96) for e in index.entries)
    # the probe index lists the skipped file too
    rows = [json.loads(line) for line in index_path(tmp_path, folder).read_text().splitlines()]
    assert sum("error" in r for r in rows) == 1


def test_probe_index_is_reused_and_refreshed(folder, tmp_path, monkeypatch):
    import dit_train.data_pipelines.video_folder as vf

    first = index_video_folder(folder, tmp_path, progress=False)
    calls = []
    real = vf.probe
    monkeypatch.setattr(vf, "probe", lambda p: calls.append(p) or real(p))
    again = index_video_folder(folder, tmp_path, progress=False)
    assert calls == [] and again.entries == first.entries  # nothing probed twice
    victim = Path(first.entries[0].path)
    victim.touch()  # changed mtime: probed again, the others are not
    index_video_folder(folder, tmp_path, progress=False)
    assert calls == [str(victim)]


def test_missing_files_are_not_probed_again_nor_the_index_rewritten(folder, tmp_path, monkeypatch):
    """A manifest naming many missing files stat-ed and rewrote its index at every dataset build
    (a million rows: 160 s per launch); a file still missing now keeps its cached row."""
    import dit_train.data_pipelines.video_folder as vf

    clips = list_clips(folder) + [(str(tmp_path / f"gone_{i}.mp4"), "a gone clip") for i in range(3)]
    index_file = tmp_path / "index.jsonl"
    first = index_clips(clips, index_file, progress=False)
    assert sum(why == "file not found" for _, why in first.skipped) == 3  # (the folder also holds a broken clip)
    stamp = index_file.stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(vf, "_probe_row", lambda p: calls.append(p) or {})
    again = index_clips(clips, index_file, progress=False)
    assert calls == [] and index_file.stat().st_mtime_ns == stamp and again.skipped == first.skipped


def test_csv_and_jsonl_manifests(folder, tmp_path):
    clips = [(p, c) for p, c in list_clips(folder)]
    rel = [(str(Path(p).relative_to(folder)), c) for p, c in clips]
    import csv

    with (folder / "list.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "caption"])
        w.writerows(rel)
    (tmp_path / "list.jsonl").write_text("".join(json.dumps({"path": p, "caption": c}) + "\n" for p, c in clips))
    assert list_clips(folder / "list.csv") == clips
    assert list_clips(tmp_path / "list.jsonl") == clips
    index = index_clips(list_clips(folder / "list.csv"), None, progress=False)
    assert len(index.entries) == 6 and len(index.skipped) == 1
    with pytest.raises(ValueError, match="does not exist"):
        list_clips(tmp_path / "nope")


class _Recording:
    """A dataset that records which thread decodes which id; id 3 is unreadable."""

    def __init__(self, n: int = 8):
        self.n, self.calls, self.lock = n, [], threading.Lock()

    def lengths(self):
        return [4] * self.n

    def __getitem__(self, i):
        with self.lock:
            self.calls.append((i, threading.current_thread().name))
        if i == 3:
            raise VideoReadError("corrupt")
        return VideoSample(torch.full((3, 2, 8, 8), float(i) / 10), f"clip {i}")


def test_prefetcher_decodes_in_background_and_reraises_errors():
    ds = _Recording()
    pf = Prefetcher(ds, num_workers=2)
    pf.prefetch([0, 1, 2, 3])
    assert pf.pending() == [0, 1, 2, 3]
    assert torch.equal(pf[2].pixels, ds[2].pixels)
    with pytest.raises(VideoReadError):
        pf[3]
    pf[0], pf[1]
    decoders = {name for i, name in ds.calls if i in (0, 1, 3)}
    assert decoders and all(name.startswith("decode") for name in decoders)  # not the caller's thread
    assert pf.pending() == []  # handed out once
    pf.prefetch([5])
    pf.prefetch([6])
    pf.prefetch([7])  # 5 was announced 2 calls ago and never read: dropped
    assert 5 not in pf.pending() and 7 in pf.pending()
    pf.close()


def test_video_task_drops_unreadable_sample_through_workers(tiny_cfg):
    from dit_train.tasks.video import VideoTask

    task = VideoTask(Prefetcher(_Recording(), 2), tiny_cfg.model, tiny_cfg.loss, seed=0)
    task.prefetch([1, 3, 4])
    batch = task.build([1, 3, 4], step=0)
    assert batch.sample_ids.tolist() == [1, 4] and task.failed == {3}


def test_trainer_announces_this_and_next_step():
    """Trainer.plan(s) hands the task the ids of step s then step s+1 (this rank's)."""
    from dit_train.engine.trainer import Trainer

    class Task:
        def __init__(self):
            self.announced = []

        def prefetch(self, ids):
            self.announced.append(list(ids))

    lengths = {i: 10 + 7 * (i % 5) for i in range(20)}
    from dit_train.config import TrainConfig

    # The real config class, so a new planning key cannot leave this test behind.
    t = TrainConfig(global_batch=6, grad_accum=1, micro_batch_tokens=60, seed=3, steps=4)
    tr = Trainer.__new__(Trainer)
    tr.task, tr.train_cfg, tr.lengths, tr.cost = Task(), t, lengths, None  # cost: train.balance=tokens
    tr.ctx = SimpleNamespace(dims=SimpleNamespace(dp=2), dp_rank=1)
    mine = lambda s: [i for p in plan_step(s, lengths, 6, 2, 1, 60, 3).micro_batches[1] for i in p]
    tr.plan(2)
    assert tr.task.announced == [mine(2) + mine(3)]
    tr.plan(3)  # the last step: nothing beyond it
    assert tr.task.announced[-1] == mine(3)


def test_num_workers_do_not_change_packs(folder, tmp_path):
    from dit_train.tasks import build_task

    packs = []
    for workers in (0, 2):
        cfg = compose_config(TINY_MODEL + ["data.max_frames=8", "data=video_folder", f"data.root={folder}", f"data.num_workers={workers}"],
                             cache_dir=str(tmp_path))
        task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
        assert isinstance(task.dataset, Prefetcher) == (workers > 0)
        assert len(task.lengths()) == 6
        ids = [0, 2, 5, 1]
        task.prefetch(ids)
        packs.append(task.build(ids, step=1))
    assert torch.equal(packs[0].tokens["x"], packs[1].tokens["x"])
    assert torch.equal(packs[0].tokens["target"], packs[1].tokens["target"])


def test_pixel_source_refuses_latent_channels(folder, tmp_path):
    from dit_train.tasks import check_data
    from dit_train.config.errors import ConfigError

    cfg = compose_config(TINY_MODEL + ["data.max_frames=8", "data=video_folder", f"data.root={folder}", "model.in_channels=16"], cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="model.in_channels=3"):
        check_data(cfg)


@pytest.mark.slow
def test_a_run_trains_on_a_video_folder(folder, tmp_path, caplog):
    """A run with `data=video_folder`: 3 steps with 2 decode workers, the corrupt file skipped and
    reported (pack equality across worker counts: test above). In this process: the command
    line's path to run_from_config is test_cli's, and a fresh process cost most of this test.
    1 corrupt file of 7 is above the default data.max_dropped_fraction (refused before step 0:
    tests/test_faults_inputs.py), so the run allows it."""
    run_dir = tmp_path / "run"
    with caplog.at_level("WARNING"):
        train_in_process(TINY_MODEL + ["data.max_frames=8", "data=video_folder", f"data.root={folder}",
                                       "data.num_workers=2", "train.steps=3", "train.global_batch=3",
                                       "data.max_dropped_fraction=0.2"],
                         run_dir, cache_dir=str(tmp_path / "cache"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["samples"] == 3 and r["tokens"] > 0 for r in rows)
    assert "skipped 1 unreadable video" in caplog.text
