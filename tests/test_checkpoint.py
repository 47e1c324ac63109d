"""Checkpoints, exact resume (same and other layouts), export, worker faults, non-finite steps,
fp16 loss scaling and bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dit_train.engine.layout_equivalence import apply_layout
from tests.conftest import TINY, train_in_process

ADAM_TINY = [o for o in TINY if not o.startswith("optim")] + ["optim=adamw", "optim.lr=3e-3", "optim.warmup_steps=2",
                                                              "optim.schedule=cosine", "train.ema_decay=0.9"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_resume_from_step_k_gives_the_same_weights(tmp_path, data_cache, capsys):
    """AdamW + cosine schedule + EMA: optimizer moments, step counters, the LR schedule and the
    EMA weights (and its update count, which sets its warm-up decay) must all come back exactly."""
    from dit_train.tools import export_weights

    base = [*ADAM_TINY, "train.steps=6", f"data.cache_dir={data_cache}"]
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process([*base, "train.ckpt_every=3", "train.keep_last=5"], full)
    ckpts = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000005"], ckpts
    capsys.readouterr()
    train_in_process([*base, f"train.resume={full / 'checkpoints' / 'step_00000002'}"], part)
    assert "resumed from" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (part / "metrics.jsonl").read_text().splitlines()] == [3, 4, 5]
    # CPU kernels with 2 threads are not bitwise deterministic run to run (~3e-8 here), so 1e-6
    assert _max_diff(load_file(full / "weights.safetensors"), load_file(part / "weights.safetensors")) < 1e-6
    assert _max_diff(load_file(full / "weights_ema.safetensors"), load_file(part / "weights_ema.safetensors")) < 1e-6
    # export from the checkpoint = the run's own final weights
    for flag, name in (([], "weights"), (["--ema"], "weights_ema")):
        out = tmp_path / f"exported_{name}.safetensors"
        assert export_weights.main([str(full), *flag, "--out", str(out)]) == 0
        assert _max_diff(load_file(full / f"{name}.safetensors"), load_file(out)) == 0.0


def test_keep_last_and_incomplete_saves_are_ignored(tmp_path):
    from dit_train.checkpoint import JSONState, list_checkpoints, resolve_checkpoint, save_checkpoint

    class Counter:
        def state_dict(self):
            return {"n": 1}

    root = tmp_path / "checkpoints"
    for step in (3, 7):  # real (tiny) checkpoints: resolve verifies what it returns
        save_checkpoint(tmp_path, step, {"counter": JSONState(Counter())}, "", keep_last=5)
    (root / ".step_00000009.tmp").mkdir()  # a crash mid-save
    half = root / "step_00000011"  # renamed dirs always hold trainer.json; this one is not ours
    half.mkdir()
    assert [s for s, _ in list_checkpoints(root)] == [3, 7]
    assert resolve_checkpoint("auto", tmp_path).name == "step_00000007"
    assert resolve_checkpoint("", tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint(str(tmp_path / "nowhere"), tmp_path)


def test_parameters_without_gradients_resume_without_optimizer_state(tmp_path):
    """A parameter no gradient reached before the save (a branch the data never runs, or has
    not run yet) has no AdamW state in the checkpoint, and none after the resume: when
    its first gradient comes, it takes the uninterrupted run's step (moments and step count
    start there), not one from torch's zero-initialised state."""
    from torch import nn

    from dit_train.checkpoint import ModelState, OptimizerState, load_checkpoint, save_checkpoint

    def build():
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(model, optimizer, used):
        sum(model[n](torch.ones(2, 3)).square().sum() for n in used).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model, optimizer = build()
    step(model, optimizer, "a")  # "b" has no gradient yet
    ck = save_checkpoint(tmp_path, 0, {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}, "", 1)
    resumed, resumed_optimizer = build()
    load_checkpoint(ck, {"model": ModelState(resumed), "optim": OptimizerState(resumed, resumed_optimizer)})
    assert [n for n, p in resumed.named_parameters() if p in resumed_optimizer.state] == ["a.weight", "a.bias"]
    for m, o in ((model, optimizer), (resumed, resumed_optimizer)):
        step(m, o, "ab")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


@pytest.mark.slow
def test_resume_on_a_different_layout_keeps_the_trajectory(tmp_path, data_cache):
    """Saved with dp_shard=2, resumed with cp_ulysses=2 (and on 1 process): same weights and
    EMA weights as an uninterrupted 1-process run (layout-invariant data + DCP resharding). SGD
    keeps the comparison about gradients (see dit_train.tools.verify_layouts); its momentum
    buffers are optimizer state that reshards too (made on the local shards: optim/local_step.py)."""
    # one block: the runs are Python-bound, and the resharding of every shard needs no second
    base = [*TINY, "model.depth=1", "train.steps=4", "train.ema_decay=0.9", "optim.momentum=0.9",
            f"data.cache_dir={data_cache}"]
    ref, a, b, c = (tmp_path / n for n in ("ref", "a", "b", "c"))
    train_in_process(base, ref)
    # the saving run stops at its checkpoint (step 1 of the 4): the steps after it would not be read
    train_in_process([*base, "parallel.dp_shard=2", "train.ckpt_every=2", "train.steps=2"], a)
    ck = a / "checkpoints" / "step_00000001"
    for run_dir, layout in ((b, ["parallel.cp_ulysses=2"]), (c, [])):
        train_in_process([*base, *layout, f"train.resume={ck}"], run_dir)
        for name in ("weights.safetensors", "weights_ema.safetensors"):  # EMA shards reshard too
            w_ref, w = load_file(ref / name), load_file(run_dir / name)
            assert _max_diff(w_ref, w) < 1e-6, (layout, name, _max_diff(w_ref, w))


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def _workers(pid: int) -> list[int]:
    """Worker processes of a local launch, lowest rank first: the children of its fork server
    (engine/launch.py forks the workers from it), or where there is no fork server multiprocessing's
    spawn children (not its resource tracker)."""
    found = []
    for c in _children(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmd:
            found.extend(_children(c))
        elif b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            found.append(c)
    return sorted(found)


def _left_after(victims: list[int], seconds: float = 1.0) -> list[int]:
    """The victims whose /proc entry is still there `seconds` after the launcher ended: orphaned
    workers. Polled, not slept: the test goes on as soon as all are gone (usually at once), and
    fails as a 1 s sleep did when one outlives the second."""
    deadline = time.time() + seconds
    while True:
        left = [v for v in victims if Path(f"/proc/{v}").exists()]
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.02)


def _start_and_kill(args: list[str], run_dir: Path, cwd: Path, kill_at_step: int):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "dit_train", *args, f"hydra.run.dir={run_dir}"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    victims: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_at_step:
            victims = _workers(proc.pid)
            if len(victims) >= 2:
                os.kill(victims[-1], signal.SIGKILL)
                break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out, victims


@pytest.mark.slow
def test_killed_worker_stops_the_run_with_an_error(tmp_path, data_cache):
    args = [*TINY, "train.steps=200", "parallel.dp_shard=2", f"data.cache_dir={data_cache}"]
    rc, out, victims = _start_and_kill(args, tmp_path / "run", tmp_path, kill_at_step=2)
    assert victims, "never saw the workers"
    assert rc != 0 and "worker rank 1 was stopped by SIGKILL" in out
    assert not _left_after(victims), "orphaned worker processes"
    steps = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert steps < 200
    # summary.json names the killed rank (rank 0 itself only saw its collective fail: kept aside)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith(
        "WorkerFailure: worker rank 1 was stopped by SIGKILL from outside the run"), summary


@pytest.mark.slow
def test_killed_worker_restarts_from_checkpoint_and_finishes_exactly(tmp_path, data_cache):
    args = [*TINY, "train.steps=12", "parallel.dp_shard=2", "train.ckpt_every=4", f"data.cache_dir={data_cache}"]
    ref = tmp_path / "ref"
    train_in_process(args, ref)  # the uninterrupted run, on the suite's workers (same code per rank)
    rc, out, victims = _start_and_kill([*args, "launcher.max_restarts=1"], tmp_path / "run", tmp_path, kill_at_step=6)
    assert victims and rc == 0, out[-3000:]
    assert "resumed from" in out
    # the log says the workers restart (it said FAILED and trained on)
    assert "restarting every worker from the newest checkpoint (restart 1 of launcher.max_restarts=1)" in out
    assert "restart 1 of launcher.max_restarts=1 after a worker failure" in out and "FAILED" not in out, out[-3000:]
    from dit_train.metrics import read_metrics

    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(12))
    assert _max_diff(load_file(ref / "weights.safetensors"), load_file(tmp_path / "run" / "weights.safetensors")) < 1e-6


def _nan_worker(cfg, nan_rank, nan_steps):
    """Train with a NaN loss injected on one rank at some steps; return weights and skips."""
    import torch.distributed as dist

    from dit_train.tasks.video import VideoTask
    from dit_train.engine.layout_equivalence import train_weights

    orig = VideoTask.per_token_loss
    state = {"calls": 0}

    def poisoned(self, model, batch, meta):
        out = orig(self, model, batch, meta)
        rank = dist.get_rank() if dist.is_initialized() else 0
        step = state["step"]
        if step in nan_steps and (nan_rank is None or rank == nan_rank):
            out = out + float("nan")
        return out

    from dit_train.engine import trainer as T

    orig_step = T.Trainer.step

    def step(self, s):
        state["step"] = s
        res = orig_step(self, s)
        state.setdefault("skipped", []).append(res.skipped)
        return res

    VideoTask.per_token_loss = poisoned
    T.Trainer.step = step
    try:
        out = train_weights([cfg])[0]
    finally:
        VideoTask.per_token_loss, T.Trainer.step = orig, orig_step
    return {"weights": out, "skipped": state["skipped"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"dp_shard": 2, "dp_mode": "ddp"}, {"cp_ring": 2, "dp_mode": "none"}])
def test_nan_on_one_rank_skips_the_step_everywhere(tiny_cfg, layout):
    from dit_train.engine.launch import launch_local
    from dit_train.engine.layout_equivalence import relative_difference

    cfg = apply_layout(tiny_cfg, {})
    cfg.train.steps = 3
    one = _nan_worker(cfg, None, {1})  # oracle: step 1 skipped on the single process
    assert one["skipped"] == [False, True, False]
    lay = apply_layout(cfg, layout)
    got = launch_local(_nan_worker, (lay, 1, {1}), 2, lay.launcher)
    for rank in got:
        assert got[rank]["skipped"] == [False, True, False], (rank, got[rank]["skipped"])
    assert relative_difference(one["weights"], got[0]["weights"]) <= 1e-4
    assert all(torch.isfinite(v).all() for v in got[0]["weights"].values())


def test_too_many_non_finite_steps_stop_with_a_clear_message(tmp_path, tiny_cfg, monkeypatch):
    from dit_train.tasks.video import VideoTask
    from dit_train.config.errors import NonFiniteTraining
    from dit_train.engine.worker import train as run

    orig = VideoTask.per_token_loss
    monkeypatch.setattr(VideoTask, "per_token_loss", lambda self, *a: orig(self, *a) * float("inf"))
    cfg = apply_layout(tiny_cfg, {})
    cfg.train.steps, cfg.train.max_skipped_steps, cfg.run_dir = 10, 2, str(tmp_path)
    with pytest.raises(NonFiniteTraining, match="train.max_skipped_steps=2"):
        run(cfg)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [1, 1, 1] and recs[-1]["skipped_total"] == 3


def test_dynamic_loss_scale_halves_on_overflow_and_grows_back():
    from dit_train.precision import DynamicLossScale

    s = DynamicLossScale(init_scale=1024.0, growth_interval=3)
    s.update(overflow=True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 1024.0


def test_fp16_lane_runs_and_skips_overflowing_steps(tmp_path, tiny_cfg, monkeypatch):
    from dit_train.tasks.video import VideoTask
    from dit_train.engine.worker import train as run

    cfg = apply_layout(tiny_cfg, {})
    cfg.train.steps, cfg.train.precision, cfg.run_dir = 4, "fp16", str(tmp_path)
    orig = VideoTask.per_token_loss
    calls = {"n": 0}

    def overflow_once(self, *a):
        calls["n"] += 1
        out = orig(self, *a)
        return out * 1e30 if calls["n"] == 1 else out  # the first micro-batch overflows when scaled

    monkeypatch.setattr(VideoTask, "per_token_loss", overflow_once)
    run(cfg)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["skipped"] == 1 and all(r["skipped"] == 0 for r in recs[1:])
    assert recs[1]["loss_scale"] == recs[0]["loss_scale"] == 2.0 ** 15  # halved once, from 2^16
    assert all(r["loss"] == r["loss"] for r in recs[1:])  # finite afterwards


def test_corrupt_and_truncated_videos_are_skipped_and_counted(tmp_path, tiny_cfg):
    """A garbage file is rejected when the dataset is built; a file that opens but cannot be
    decoded later is dropped from its step (same on every layout) and counted."""
    from dit_train.data_pipelines.synthetic_video import dataset_dir
    from dit_train.data_pipelines.video_dataset import VideoClipDataset
    from dit_train.tasks.video import VideoTask

    c = tiny_cfg.data
    src = dataset_dir(c.cache_dir, c.num_clips, c.gen_seed, c.num_images, c.widths, c.heights, c.frames,
                      c.heldout_compositions)
    rows = [json.loads(x) for x in (src / "manifest.jsonl").read_text().splitlines()][:4]
    for r in rows:
        r["path"] = str(src / r["path"])
    (tmp_path / "garbage.mp4").write_bytes(b"\x00not a video" * 100)
    trunc = tmp_path / "truncated.mp4"
    trunc.write_bytes((src / "clip_0000.mp4").read_bytes()[:600])
    rows.append({"path": str(tmp_path / "garbage.mp4"), "caption": "x"})  # no metadata: probed, fails
    rows.append({"path": str(trunc), "caption": "y", "frames": 8, "height": 32, "width": 32, "fps": 8})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows))
    ds = VideoClipDataset.from_manifest(manifest, patch=(2, 8, 8), max_frames=8)
    assert len(ds) == 5 and [p for p, _ in ds.skipped] == [str(tmp_path / "garbage.mp4")]
    task = VideoTask(ds, tiny_cfg.model, tiny_cfg.loss, 0)
    batch = task.build([0, 4, 1], step=0)
    assert batch.sample_ids.tolist() == [0, 1] and task.failed == {4}
    assert set(batch.seg.unique().tolist()) == {0, 1}


def test_unreadable_or_empty_text_corpora_are_clear_errors(tmp_path):
    from dit_train.data_pipelines.text import load_text_datasets

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_text_datasets(str(tmp_path / "missing.txt"), "byte", 64, 0.0)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_text_datasets(str(tmp_path / "empty.jsonl"), "byte", 64, 0.0)


def test_data_problems_are_refused_before_training(tmp_path, data_cache):
    """An empty text file, and clips longer than the micro-batch, are ConfigErrors of
    run_from_config before any step runs (the CLI prints any of them as its one `error:` line:
    tests/test_cli.py::test_bad_override_fails_before_running). In this process: a CLI run
    costs a fresh Python importing torch, and the quickstart's data generated anew."""
    from dit_train.config.errors import ConfigError

    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        train_in_process(["mode=llm", f"data.text_path={tmp_path / 'empty.txt'}"], tmp_path / "r")
    with pytest.raises(ConfigError, match="raise train.micro_batch_tokens"):
        train_in_process([*TINY, "train.micro_batch_tokens=10"], tmp_path / "s", cache_dir=data_cache)
    assert not (tmp_path / "r" / "metrics.jsonl").exists() and not (tmp_path / "s" / "metrics.jsonl").exists()
