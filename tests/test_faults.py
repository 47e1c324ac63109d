"""The fault suite: each fault or bad input a user can meet, injected, and the behaviour we
promise (docs/checkpoints.md, "Faults and bad inputs"). Runs go through the CLI's own entry
(`run_from_config`) in this process unless the fault needs workers."""
from __future__ import annotations

import errno
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

from tests.conftest import TINY, compose_config, train_in_process

BASE = [*TINY, "train.steps=4", "train.ckpt_every=2", "train.keep_last=5"]


def _run(overrides: list[str], run_dir: Path, data_cache: str) -> dict:
    return train_in_process(overrides, run_dir, cache_dir=data_cache)


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- resume contract ---------------------------------------------------------------------------


def test_resume_applies_a_new_lr_keeps_each_segment_config_and_logs_each_step_once(tmp_path, data_cache, finished_run):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)  # a run of BASE that finished there (trained once per module)
    assert _steps(run) == [0, 1, 2, 3] and not list(run.glob("resume_*.yaml"))
    first_config = (run / "config.yaml").read_text()
    ck = run / "checkpoints" / "step_00000001"  # steps 2 and 3 will be replayed
    _run([*BASE, "train.steps=6", "optim.lr=0.25", f"train.resume={ck}"], run, data_cache)
    assert _steps(run) == [0, 1, 2, 3, 4, 5]  # replayed steps replace the old rows, once each
    assert (run / "config.yaml").read_text() == first_config  # never overwritten
    assert "lr: 0.25" in (run / "resume_00000002.yaml").read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["lr"] == 0.5 and rows[2]["lr"] == 0.25  # the new LR took effect at the resumed step


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_cache) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    _run(BASE, run, data_cache)
    return run


@pytest.mark.parametrize("change,key", [("train.seed=5", "train.seed"), ("model.dim=48", "model.dim"),
                                        ("optim=adamw", "optim.name"), ("loss.reduction=token_mean", "loss.reduction"),
                                        ("data.num_clips=12", "data.num_clips")])
def test_resume_refuses_a_different_experiment_before_writing_anything(tmp_path, data_cache, finished_run, change, key):
    import shutil

    from dit_train.config.errors import RunFolderError

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(RunFolderError) as err:
        _run([*BASE, "train.steps=6", change, "train.resume=auto"], run, data_cache)
    msg = str(err.value)
    assert f"{key}:" in msg and "put back" in msg and "new run folder" in msg, msg
    after = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before and not list(run.glob("resume_*.yaml"))


# -- folder ownership ----------------------------------------------------------------------------


def test_resume_auto_with_outputs_but_no_checkpoint_says_why_it_cannot_continue(tmp_path, caplog):
    """A run stopped before its first checkpoint, then train.resume=auto: it warned "starting from
    step 0" and then refused with "continue it with train.resume=auto" — the flag just given."""
    from dit_train.config.errors import RunFolderError
    from dit_train.engine.run_folder import open_run_folder

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"status": "interrupted"}')
    cfg = compose_config(BASE)
    cfg.run_dir = str(run)
    with pytest.raises(RunFolderError, match=r"train.resume=auto: run folder .* holds a run's outputs \(summary.json\) "
                                             r"but no checkpoint to continue from .* train.overwrite=true"):
        open_run_folder(cfg, "auto")
    assert "starting from step 0" not in caplog.text


def test_a_new_run_into_a_used_folder_is_refused_unless_overwrite(tmp_path, data_cache, finished_run):
    import shutil

    from dit_train.config.errors import RunFolderError

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)  # a run of BASE that finished there (trained once per module)
    old = load_file(run / "weights.safetensors")
    with pytest.raises(RunFolderError, match="holds another run's outputs.*train.resume=auto.*train.overwrite=true"):
        _run(BASE, run, data_cache)
    _run([*BASE, "train.overwrite=true", "train.seed=3"], run, data_cache)
    (moved,) = run.glob("overwritten_*")
    assert _steps(moved) == [0, 1, 2, 3] and len(list((moved / "checkpoints").iterdir())) == 2  # nothing lost
    assert all(torch.equal(old[k], v) for k, v in load_file(moved / "weights.safetensors").items())
    assert _steps(run) == [0, 1, 2, 3]


def test_two_runs_at_once_into_one_folder(tmp_path, data_cache):
    from dit_train.config.errors import RunFolderError
    from dit_train.engine.run_folder import open_run_folder

    cfg = compose_config([*BASE, f"data.cache_dir={data_cache}"])
    cfg.run_dir = str(tmp_path / "run")
    holder = open_run_folder(cfg, "")  # a first run holds the folder
    try:
        with pytest.raises(RunFolderError, match=f"in use by pid {os.getpid()}"):
            _run(BASE, tmp_path / "run", data_cache)
    finally:
        holder.release()


def test_pruning_only_removes_this_runs_checkpoints(tmp_path, tiny_cfg):
    from dit_train.checkpoint import list_checkpoints, save_checkpoint
    from dit_train.checkpoint.parts import JSONState

    class Counter:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, s):
            pass

    parts = {"counter": JSONState(Counter())}
    save_checkpoint(tmp_path, 0, parts, "", keep_last=5, run_id="other")  # another run's
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, parts, "", keep_last=1, run_id="mine")
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [0, 3]


# -- bad data: no silent success -----------------------------------------------------------------


def _undecodable(monkeypatch, fail) -> None:
    import dit_train.data_pipelines.video_dataset as vd
    from dit_train.data_pipelines.video_io import VideoReadError

    orig = vd.read_frames

    def read_frames(path, indices, info):
        if fail(path):
            raise VideoReadError(f"cannot decode frames of {path}: injected")
        return orig(path, indices, info)

    monkeypatch.setattr(vd, "read_frames", read_frames)


def test_every_clip_undecodable_fails_the_run_naming_files(tmp_path, data_cache, monkeypatch):
    from dit_train.config.errors import DataFailure

    _undecodable(monkeypatch, lambda path: True)
    run = tmp_path / "run"
    with pytest.raises(DataFailure, match=r"step 0: none of the 6 samples.*clip_\d+\.mp4: injected"):
        _run([*BASE, "data.decoded_cache_items=0"], run, data_cache)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "DataFailure" in summary["error"] and summary["steps_done"] == 0
    assert summary["final_loss"] is None  # no step was done (it said 0.0)
    assert not (run / "weights.safetensors").exists()


def test_too_many_unreadable_clips_fail_the_run_at_the_end(tmp_path, data_cache, monkeypatch):
    from dit_train.config.errors import DataFailure

    _undecodable(monkeypatch, lambda path: path.endswith(("clip_0003.mp4", "clip_0007.mp4")))
    with pytest.raises(DataFailure, match=r"samples read so far could not be decoded.*max_dropped_fraction=0.05"):
        _run([*BASE, "train.steps=3", "data.decoded_cache_items=0"], tmp_path / "run", data_cache)
    # a higher threshold accepts the same data, counted in metrics and summary
    _run([*BASE, "train.steps=3", "data.decoded_cache_items=0", "data.max_dropped_fraction=0.5"], tmp_path / "ok",
         data_cache)
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["samples_dropped"] > 0


# -- storage -------------------------------------------------------------------------------------


def test_unwritable_folder_and_full_disk_are_refused_before_step_0(tmp_path, data_cache, monkeypatch):
    from dit_train.config.errors import RunFolderError

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(RunFolderError, match="not writable"):
        _run(BASE, tmp_path / "a_file" / "run", data_cache)
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 9, 10 ** 9 - 1000, 1000))
    with pytest.raises(RunFolderError, match="free but keeping 5 checkpoints needs"):
        _run(BASE, tmp_path / "run", data_cache)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_failing_save_is_one_clear_error_and_keeps_the_last_checkpoint(tmp_path, data_cache, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from dit_train.config.errors import CheckpointError
    from dit_train.checkpoint import verify_checkpoint

    orig, calls = dcp.save, {"n": 0}

    def save(state, checkpoint_id):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(checkpoint_id))
        return orig(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", save)
    run = tmp_path / "run"
    with pytest.raises(CheckpointError, match=r"step 3 to .*checkpoints: No space left on device.*newest complete "
                                              r"checkpoint is .*step_00000001"):
        _run(BASE, run, data_cache)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]  # no half checkpoint
    assert verify_checkpoint(run / "checkpoints" / "step_00000001") == ""
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, data_cache, finished_run, caplog):
    import shutil

    ref, run = tmp_path / "ref", tmp_path / "run"
    _run([*BASE, "train.steps=6"], ref, data_cache)
    shutil.copytree(finished_run, run)  # a run of BASE: checkpoints at steps 1 and 3
    shard = next((run / "checkpoints" / "step_00000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    _run([*BASE, "train.steps=6", "train.resume=auto"], run, data_cache)
    assert "skipping damaged checkpoint" in caplog.text and "step_00000003" in caplog.text
    assert json.loads((run / "run.json").read_text())["resumed_from"].endswith("step_00000001")
    a, b = load_file(ref / "weights.safetensors"), load_file(run / "weights.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6  # the same trajectory


# -- outputs and safe loading --------------------------------------------------------------------


def test_metrics_are_strict_json():
    from dit_train.metrics import strict_json

    row = strict_json({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    assert json.loads(json.dumps(row, allow_nan=False)) == {"step": 3, "loss": None, "grad_norm": None, "lr": 0.1,
                                                             "nonfinite": ["loss", "grad_norm"]}


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dit_train_pwned",))


def test_a_pickled_object_in_a_checkpoint_is_refused_not_executed(tmp_path):
    from dit_train.config.errors import CheckpointError
    from dit_train.checkpoint.store import _load_rng

    Path("/tmp/dit_train_pwned").unlink(missing_ok=True)
    torch.save({"torch": torch.get_rng_state(), "cuda": _Exploit()}, tmp_path / "rng_rank0.pt")
    with pytest.raises(CheckpointError, match="holds more than tensors and was not loaded"):
        _load_rng(tmp_path)
    assert not Path("/tmp/dit_train_pwned").exists()


# -- newcomer path -------------------------------------------------------------------------------


def test_micro_batch_budget_defaults_to_the_longest_sample(tmp_path, data_cache):
    from dit_train.tasks import check_data, resolve_config

    cfg = compose_config([f"data.cache_dir={data_cache}", "data.num_clips=16", "model.patch_size=[1,4,4]",
                          "train.micro_batch_tokens=0", "data.widths=[32,64,96]", "data.heights=[32,48,64]",
                          "data.frames=[4,24]", "data.max_frames=16"])
    assert cfg.train.micro_batch_tokens == 0  # auto
    from dit_train.data_pipelines import prepare_data

    prepare_data(cfg.data, cfg.model)  # the set is written on first use (not by an earlier test)
    resolved = resolve_config(cfg, check_data(cfg))
    from dit_train.tasks import build_task

    longest = max(build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, 0).lengths())
    assert longest > 2048 and resolved.train.micro_batch_tokens == longest
    assert cfg.train.micro_batch_tokens == 0  # resolved on a copy


@pytest.mark.parametrize("budget", [0, 400])
def test_a_run_reads_its_config_and_records_what_it_resolved(tmp_path, data_cache, budget):
    """The config a run is given is read, never changed: the auto budget (0) and the resume point
    are resolved on a copy, and that copy is what the run folder's config.yaml and checkpoints record."""
    import copy

    from dit_train.__main__ import run_from_config
    from dit_train.compose import load_config
    from dit_train.config.schema import AUTO_MICRO_BATCH_TOKENS

    cfg = compose_config([*TINY, "train.steps=1", "train.ckpt_every=1", f"train.micro_batch_tokens={budget}",
                          "train.resume=auto"], cache_dir=data_cache)
    cfg.run_dir = str(tmp_path / "run")
    before = copy.deepcopy(cfg)
    run_from_config(cfg)
    assert cfg == before
    for recorded in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000000"):
        # auto: the default budget, as TINY's clips are shorter
        assert load_config(recorded).train.micro_batch_tokens == (budget or AUTO_MICRO_BATCH_TOKENS)


def test_guidance_without_caption_dropout_warns(caplog):
    from dit_train.engine.checks import check_config

    cfg = compose_config(["train.guidance_scale=3", "data.caption_dropout=0"])
    check_config(cfg)
    assert "data.caption_dropout=0" in caplog.text and "guidance" in caplog.text


def test_help_lists_keys_with_descriptions(monkeypatch, capsys):
    """`python -m dit_train --help`: its entry point in this process (a fresh Python cost ~5 CPU-s;
    `python -m dit_train` reaching cli() is what every CLI launch of the suite runs)."""
    from dit_train.__main__ import cli

    monkeypatch.setattr(sys, "argv", ["dit_train", "--help"])
    cli()  # returns, as the process exits 0: no Hydra, no run
    out = capsys.readouterr().out
    assert "train.global_batch" in out and "samples per optimizer step" in out
    assert "data.* of data=video_folder" in out and "model.* of model.name=wan" in out


# -- workers -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_frozen_worker_is_named_and_every_worker_stopped(tmp_path, data_cache):
    """SIGSTOP one worker: the others wait in a collective; the heartbeat names the frozen rank
    and the run stops long before the collective timeout (600 s)."""
    from tests.test_checkpoint import _left_after, _workers

    run = tmp_path / "run"
    args = [*TINY, "train.steps=500", "parallel.dp_shard=2", "launcher.heartbeat_timeout_s=5",
            f"data.cache_dir={data_cache}", f"hydra.run.dir={run}"]
    proc = subprocess.Popen([sys.executable, "-m", "dit_train", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    victims: list[int] = []
    deadline = time.time() + 240
    while time.time() < deadline and not victims:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
            victims = _workers(proc.pid)
        time.sleep(0.1)
    assert len(victims) == 2, "never saw the workers"
    os.kill(victims[1], signal.SIGSTOP)
    stopped_at = time.time()
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0 and time.time() - stopped_at < 120
    assert "stopped making progress" in out and "launcher.heartbeat_timeout_s=5" in out, out[-2000:]
    assert not _left_after(victims), "orphaned worker processes"



def test_compile_on_cuda_is_refused_before_the_run(monkeypatch):
    """train.compile on a GPU trained on wrong gradients in the GPU check (docs/performance.md):
    refused with one line that says what to set; on the CPU it stays allowed."""
    from dit_train.compose import compose
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import COMPILE_ON_CUDA, check_config

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # device=auto on a GPU machine
    with pytest.raises(ConfigError) as err:
        check_config(compose(["train.compile=true"]))
    assert COMPILE_ON_CUDA in str(err.value) and "train.compile=false" in str(err.value)
    check_config(compose(["train.compile=true", "parallel.device=cpu"]))


def test_an_unknown_plus_key_is_refused_naming_the_key_it_meant(tmp_path):
    """Hydra suggests `+train.stpes=3` for a typo; the key then joined the node and the run trained
    without the setting. Now one error line with the schema's closest key, and nothing written."""
    proc = subprocess.run([sys.executable, "-m", "dit_train", "+train.stpes=3", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert err == ["error: unknown config key train.stpes (did you mean train.steps?): not in the schema "
                   "(python -m dit_train --help lists the keys)"], proc.stderr
    run = tmp_path / "run"
    assert not run.exists() or not any(run.iterdir())  # nothing claimed (Hydra may create the empty folder)


@pytest.mark.parametrize("overrides, says", [
    (["model.heads=0"], "model.heads=0 must be >= 1"),  # was ZeroDivisionError in the checks themselves
    (["train.seed=-1"], "train.seed=-1 must be >= 0"),  # was numpy's ValueError inside the run
    (["model=wan_tiny", "model.pretrained={tmp}/missing"], "missing is not a folder"),
    (["model=wan_tiny", "model.pretrained={tmp}"], "holds no .safetensors weights"),  # a .bin only
])
def test_inputs_known_before_the_run_are_refused_before_it(tmp_path, overrides, says):
    """Each of these was a traceback from inside the run, after the run folder was claimed (so the
    corrected rerun into that folder was refused too): now a ConfigError from check_config."""
    from dit_train.compose import compose
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        check_config(compose([o.format(tmp=tmp_path) for o in overrides]))
