"""The fault suite, checkpoints and storage: forged checkpoints (loading never runs code from a
file), saves failing inside torch's writer, interrupted saves, checkpoints without their
integrity record, summary.json on a full disk (docs/checkpoints.md, "Faults and bad inputs
tried"). Runs go through the CLI's own entry (`run_from_config`) in this process."""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config
from tests.test_faults import BASE, _run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_cache) -> Path:
    """A finished run with checkpoints at steps 1 and 3."""
    run = tmp_path_factory.mktemp("finished") / "run"
    _run(BASE, run, data_cache)
    return run


# -- forged checkpoints ----------------------------------------------------------------------------


class _Marker:
    """Unpickling this object creates a file: the proof that loading ran code from a file."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _forge(ckpt: Path, marker: Path) -> None:
    """A pickle payload as DCP's `.metadata`, and an integrity record rewritten to match it."""
    import pickle

    from dit_train.checkpoint.integrity import INTEGRITY, integrity_record

    (ckpt / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    (ckpt / INTEGRITY).write_text(json.dumps(integrity_record(ckpt)))


def _open_resume(run: Path, data_cache: str) -> int:
    _run([*BASE, "train.steps=6", "train.resume=auto"], run, data_cache)
    return 0


def _open_export(run: Path, data_cache: str) -> int:
    from dit_train.tools import export_weights

    return export_weights.main([str(run)])


def _open_sample(run: Path, data_cache: str) -> int:
    from dit_train.tools import sample

    for name in ("weights.safetensors", "weights_ema.safetensors"):
        (run / name).unlink(missing_ok=True)  # a run without exported weights samples its newest checkpoint
    return sample.main([str(run), "--prompt", "a red circle", "--steps", "1"])


def _open_session(run: Path, data_cache: str) -> int:
    from dit_train.posttrain.session import TrainingSession

    TrainingSession.load(run)
    return 0


@pytest.mark.parametrize("open_it", [_open_resume, _open_export, _open_sample, _open_session],
                         ids=["resume", "export_weights", "sample", "session_load"])
def test_a_forged_checkpoint_is_refused_and_runs_no_code(tmp_path, data_cache, finished_run, open_it, capsys):
    from dit_train.config.errors import CheckpointError

    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished_run, run)
    _forge(run / "checkpoints" / "step_00000003", marker)
    capsys.readouterr()
    try:
        code = open_it(run, data_cache)
        err = capsys.readouterr().err.strip()  # the tools print their one line and return 2
    except CheckpointError as e:  # python -m dit_train prints it as one `error:` line; the session API raises it
        code, err = 1, f"error: {e}"
    assert not marker.exists(), "loading the checkpoint ran code from its .metadata"
    assert code != 0
    assert err.startswith("error: ") and "\n" not in err, err
    assert "step_00000003/.metadata holds a pickled reference to" in err and "refused" in err, err


def test_non_tensor_values_and_storage_paths_of_a_checkpoint_are_read_safely(tmp_path):
    """The other pickles DCP reads: non-tensor values (torch.save'd bytes, loaded by torch with
    weights_only=False) and the storage index's file names."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from dit_train.config.errors import UnsafeCheckpoint
    from dit_train.checkpoint.safe_load import load, read_metadata

    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3), "lr": _Marker(marker)}, checkpoint_id=str(tmp_path / "a"))
    state = {"w": torch.zeros(3), "lr": 0.0}
    with pytest.raises(UnsafeCheckpoint, match=r"a/__0_0.distcp holds an object that is not plain data as the value of lr"):
        load(state, tmp_path / "a")
    assert not marker.exists()
    dcp.save({"w": torch.ones(3), "lr": 0.5, "betas": (0.9, 0.99)}, checkpoint_id=str(tmp_path / "b"))
    state = {"w": torch.zeros(3), "lr": 0.0, "betas": (0.0, 0.0)}
    load(state, tmp_path / "b")  # what optimizers store (numbers, tuples) loads
    assert torch.equal(state["w"], torch.ones(3)) and state["lr"] == 0.5 and state["betas"] == (0.9, 0.99)

    md = read_metadata(tmp_path / "b")
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (tmp_path / "b" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpoint, match="a storage entry outside its folder"):
        read_metadata(tmp_path / "b")


# -- failed and interrupted saves ----------------------------------------------------------------------


def _failing_writer(monkeypatch, error: BaseException, when) -> None:
    """torch's DCP writer raising `error` while `when()` holds. The tests may run as root, where
    chmod does not stop writes, so an unwritable folder is simulated at the writer; DCP wraps
    whatever its writer raises into CheckpointException, a BaseException, as on a real full disk."""
    import torch.distributed.checkpoint.filesystem as fs

    orig = fs._write_item

    def write_item(*args, **kwargs):
        if when():
            raise error
        return orig(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", write_item)


def test_a_save_failing_in_the_writer_ends_the_run_cleanly_and_resume_works_after(tmp_path, data_cache, monkeypatch):
    from dit_train.config.errors import CheckpointError

    run, steps = tmp_path / "run", [*BASE, "train.steps=2", "train.ckpt_every=1"]
    first = run / "checkpoints" / "step_00000000"
    _failing_writer(monkeypatch, OSError(errno.ENOSPC, "No space left on device"), first.exists)
    with pytest.raises(CheckpointError) as err:
        _run(steps, run, data_cache)
    msg = str(err.value)
    assert "\n" not in msg and f"step 1 to {run / 'checkpoints'}: No space left on device" in msg, msg
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [first.name]  # no .tmp left
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"CheckpointError: {msg}"
    monkeypatch.undo()  # the cause is fixed
    _run([*steps, "train.resume=auto"], run, data_cache)
    assert json.loads((run / "run.json").read_text())["resumed_from"] == str(first)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "Permission denied"), KeyboardInterrupt()],
                         ids=["unwritable", "ctrl_c"])
def test_a_save_failing_in_the_writer_is_one_line_but_ctrl_c_stays_an_interrupt(tmp_path, monkeypatch, error):
    from dit_train.config.errors import CheckpointError
    from dit_train.checkpoint import ModelState, save_checkpoint

    _failing_writer(monkeypatch, error, lambda: True)
    parts = {"model": ModelState(torch.nn.Linear(2, 2))}
    expected = KeyboardInterrupt if isinstance(error, KeyboardInterrupt) else CheckpointError
    with pytest.raises(expected) as err:
        save_checkpoint(tmp_path, 0, parts, "", keep_last=2)
    if expected is CheckpointError:
        assert str(err.value) == (f"could not write the checkpoint of step 0 to {tmp_path / 'checkpoints'}: "
                                  f"Permission denied; free space or fix permissions there")
        assert not list((tmp_path / "checkpoints").iterdir())  # the partial .tmp is gone


def test_an_interrupted_save_does_not_count_against_the_free_space(tmp_path, data_cache, finished_run, monkeypatch):
    from dit_train.engine.run_folder import checkpoint_bytes, open_run_folder

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    cfg = compose_config([*BASE, "train.steps=6", f"data.cache_dir={data_cache}"])
    cfg.run_dir = str(run)
    leftover = run / "checkpoints" / ".step_00000005.tmp"  # a save killed midway, as big as all kept checkpoints
    leftover.mkdir()
    with open(leftover / "__0_0.distcp", "wb") as f:
        f.truncate(int(checkpoint_bytes(cfg) * (cfg.train.keep_last + 1) * 1.1))  # sparse: costs no disk
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 9, 10 ** 9 - 1000, 1000))
    open_run_folder(cfg, "auto").release()
    assert not leftover.exists()


# -- checkpoints without their integrity record -------------------------------------------------------


def test_a_checkpoint_without_its_integrity_record_is_checked_by_its_index(tmp_path, data_cache, finished_run, caplog):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / "integrity.json").unlink()
    index = run / "checkpoints" / "step_00000003" / ".metadata"
    index.write_bytes(index.read_bytes()[:100])  # damaged (before: EOFError in the middle of the resume)
    _run([*BASE, "train.resume=auto"], run, data_cache)
    assert "skipping damaged checkpoint" in caplog.text and "step_00000003/.metadata is not a readable" in caplog.text
    assert "step_00000001 has no integrity.json: checked that the files its .metadata lists" in caplog.text
    assert json.loads((run / "run.json").read_text())["resumed_from"].endswith("step_00000001")


@pytest.mark.parametrize("damage", ["metadata", "truncated_shard"])
def test_a_damaged_checkpoint_without_record_or_index_falls_back_saying_why(tmp_path, finished_run, caplog, damage):
    from dit_train.checkpoint import resolve_checkpoint

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    latest = run / "checkpoints" / "step_00000003"
    if damage == "metadata":  # before: silently skipped
        (latest / ".metadata").unlink()
        why = "(.metadata is missing)"
    else:
        (latest / "integrity.json").unlink()
        shard = next(latest.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-10])
        why = f"({shard.name} has "
    assert resolve_checkpoint("auto", run) == run / "checkpoints" / "step_00000001"
    assert f"skipping damaged checkpoint {latest} {why}" in caplog.text


def _edit_trainer_json(ckpt: Path, **values) -> None:
    meta = json.loads((ckpt / "trainer.json").read_text())
    meta.update(values)
    (ckpt / "trainer.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, why", [
    ("truncated_rng", "(rng_rank0.safetensors is damaged"),
    ("rng_of_floats", "(rng_rank0.safetensors holds torch as F32, not a generator state (uint8))"),
    ("step_abc", "(trainer.json has step='abc' (a step is an integer >= 0))"),
    ("step_negative", "(trainer.json has step=-7 (a step is an integer >= 0))"),
    ("integrity_list", "(integrity.json is not a record of file sizes and checksums)"),
])
def test_damaged_checkpoint_parts_fall_back_to_the_previous_saying_why(tmp_path, finished_run, caplog, damage, why):
    """Each was a traceback in the middle of the resume (the truncated RNG file even with no
    integrity record to catch it): now the checkpoint counts as damaged and the previous is used."""
    from safetensors.torch import save_file

    from dit_train.checkpoint import resolve_checkpoint

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    latest = run / "checkpoints" / "step_00000003"
    if damage != "integrity_list":
        (latest / "integrity.json").unlink()  # no record: the checks of the parts themselves must see it
    rng = latest / "rng_rank0.safetensors"
    if damage == "truncated_rng":
        rng.write_bytes(rng.read_bytes()[:-7])
    elif damage == "rng_of_floats":
        save_file({"torch": torch.zeros(5000)}, str(rng))
    elif damage.startswith("step_"):
        _edit_trainer_json(latest, step="abc" if damage == "step_abc" else -7)
    else:
        (latest / "integrity.json").write_text("[1, 2]")
    assert resolve_checkpoint("auto", run) == run / "checkpoints" / "step_00000001"
    assert f"skipping damaged checkpoint {latest} {why}" in caplog.text, caplog.text


def test_a_scheduler_entry_that_does_not_load_is_one_checkpoint_error(tmp_path, data_cache, finished_run):
    from dit_train.checkpoint import load_checkpoint
    from dit_train.config.errors import CheckpointError
    from dit_train.engine.build import build_run

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    latest = run / "checkpoints" / "step_00000003"
    meta = json.loads((latest / "trainer.json").read_text())
    meta["parts"]["scheduler"] = {"last_epoch": "not a number", "_step_count": None}
    (latest / "trainer.json").write_text(json.dumps(meta))
    built = build_run(compose_config(BASE, cache_dir=data_cache))
    with pytest.raises(CheckpointError, match=r"trainer.json: its scheduler state does not load"):
        load_checkpoint(latest, built.checkpoint_parts())


# -- summary.json on a full disk ---------------------------------------------------------------------


@pytest.mark.parametrize("room", ["for_one_copy", "for_none"])
def test_summary_on_a_full_disk_is_whole_or_absent_never_empty_or_stale(tmp_path, monkeypatch, room):
    from dit_train.engine.summary import write_summary

    (tmp_path / "summary.json").write_text('{"status": "completed"}')  # an earlier segment's
    real_write = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == "summary.json.tmp" or room == "for_none":  # no room for a second copy
            real_write(self, text[:3], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    write_summary(tmp_path, {"status": "failed"})
    assert not (tmp_path / "summary.json.tmp").exists()
    if room == "for_one_copy":
        assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "failed"}
    else:
        assert not (tmp_path / "summary.json").exists()


def test_metrics_rows_dropped_on_resume_on_a_full_disk_leave_no_stray_file(tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl without the replayed steps' rows. It wrote a fixed
    `metrics.tmp` beside it, left behind half-written when the write failed; now through
    dit_train/atomic.py like every other writer: the old file intact, no temporary file left."""
    from dit_train.metrics import drop_rows_from

    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(6))
    path.write_text(rows)
    real_write = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self != path:  # the rewrite's temporary file: half of it, then the disk is full
            real_write(self, text[:5], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(OSError):
        drop_rows_from(path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"] and path.read_text() == rows
    monkeypatch.undo()
    drop_rows_from(path, 3)
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# -- a run folder's config.yaml is data -------------------------------------------------------------


def _forge_configs(run: Path, edit) -> None:
    """Every config.yaml of `run` (the run's, each checkpoint's) rewritten by `edit`, and each
    checkpoint's integrity record rewritten to match, as a forger would."""
    from dit_train.checkpoint.integrity import INTEGRITY, integrity_record

    for stored in run.rglob("config.yaml"):
        stored.write_text(edit(stored.read_text()))
        if (stored.parent / INTEGRITY).exists():
            (stored.parent / INTEGRITY).write_text(json.dumps(integrity_record(stored.parent)))


@pytest.mark.parametrize("open_it", [_open_export, _open_sample, _open_session],
                         ids=["export_weights", "sample", "session_load"])
def test_a_forged_run_config_is_never_resolved(tmp_path, data_cache, finished_run, open_it, capsys):
    """An interpolation in a stored config.yaml (`${oc.env:SECRET}` in a data URL would send the
    secret to a server) is refused before anything resolves it: one `error:` line naming the file."""
    from omegaconf import OmegaConf

    from dit_train.config.errors import ConfigError

    resolved = []
    OmegaConf.register_new_resolver("spy_forged", lambda *a: resolved.append(a) or "x", replace=True)
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _forge_configs(run, lambda text: text.replace("cache_dir: ", "cache_dir: /x/${spy_forged:}${oc.env:HOME}/", 1))
    capsys.readouterr()
    try:
        code, err = open_it(run, data_cache), capsys.readouterr().err.strip()
    except ConfigError as e:  # the session API raises it
        code, err = 1, f"error: {e}"
    assert not resolved and code != 0
    assert err.startswith("error: ") and "\n" not in err, err
    assert "config.yaml holds interpolations (data.cache_dir)" in err, err


@pytest.mark.parametrize("damage, says", [("tag", "is not a readable config"), ("unknown_key", "Key 'stpes'"),
                                          ("not_a_config", "no model and data sections")])
def test_a_malformed_run_config_is_one_error_naming_the_file(tmp_path, finished_run, capsys, damage, says):
    from dit_train.tools import export_weights

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _forge_configs(run, lambda text: {"tag": text + "\nextra: !!python/object/apply:os.system ['true']\n",
                                      "unknown_key": text.replace("train:\n", "train:\n  stpes: 3\n", 1),
                                      "not_a_config": "- 1\n- 2\n"}[damage])
    capsys.readouterr()
    assert export_weights.main([str(run / "checkpoints" / "step_00000003")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "step_00000003/config.yaml" in err and says in err, err


def test_a_stored_config_cannot_switch_pickle_loading_on(tmp_path, caplog):
    """model.allow_pickle_weights (torch.load of a .bin runs its code) comes only from the command
    line of the current invocation: a stored config's true is reset, with a warning."""
    from dit_train.compose import load_config
    from dit_train.config import to_yaml

    text = to_yaml(compose_config(["model=wan_tiny"]))
    assert "allow_pickle_weights: false" in text
    (tmp_path / "config.yaml").write_text(text.replace("allow_pickle_weights: false", "allow_pickle_weights: true"))
    assert load_config(tmp_path).model.allow_pickle_weights is False
    assert "cannot widen trust" in caplog.text


def test_a_stored_config_read_again_is_the_files_own_and_the_callers_copy(tmp_path, caplog):
    """load_config keeps what it parsed per file text (the tools read one run's config again and
    again): a read again warns again, hands out a new copy, and sees the file's new text."""
    from dit_train.compose import load_config
    from dit_train.config import to_yaml

    text = to_yaml(compose_config(["model=wan_tiny"])).replace("allow_pickle_weights: false", "allow_pickle_weights: true")
    (tmp_path / "config.yaml").write_text(text)
    first = load_config(tmp_path)
    first.train.steps = 12345  # the caller's copy
    caplog.clear()
    again = load_config(tmp_path)
    assert again.model.allow_pickle_weights is False and "cannot widen trust" in caplog.text
    assert again.train.steps != 12345
    (tmp_path / "config.yaml").write_text(text.replace(f"\n  steps: {again.train.steps}\n", "\n  steps: 7\n"))
    assert load_config(tmp_path).train.steps == 7


def test_a_pickle_refusal_names_what_was_refused_not_torchs_retry_advice(tmp_path):
    """torch's message starts with "Re-running torch.load with weights_only set to False will
    likely succeed": quoted in our refusal, it told the user to do the one unsafe thing."""
    from dit_train.checkpoint.store import _load_rng
    from dit_train.config.errors import CheckpointError

    torch.save({"torch": torch.get_rng_state(), "x": _Marker(tmp_path / "pwned")}, tmp_path / "rng_rank0.pt")
    with pytest.raises(CheckpointError) as err:
        _load_rng(tmp_path)
    msg = str(err.value)
    assert "weights_only" not in msg and "add_safe_globals" not in msg, msg
    assert "a reference to io.open" in msg and "was not loaded" in msg, msg
    assert not (tmp_path / "pwned").exists()
