"""Experiment trackers (`train.loggers`): TensorBoard keeps its outputs, W&B (offline here: no
network) gets the run's config, metrics, validation grid and clips in the run folder, and a
resume continues the same W&B run; only rank 0 feeds them; a tracker name nobody registered is
refused up front."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.conftest import TINY, train_in_process

VALIDATION = ["train.steps=3", "train.sample_every=3", "train.num_samples=2", "train.sample_steps=2"]
# W&B keeps a per-process service and singleton state: each launch gets fresh processes, as a
# user's launches do (not the suite's reusable workers, and W&B runs not in the pytest process,
# where after hundreds of tests a run's offline file once lacked its run record)
pytestmark = pytest.mark.real_launcher

WANDB = ["train.loggers=[tensorboard,wandb]", "train.wandb_mode=offline"]


def _run(overrides: list[str], run_dir: Path, data_cache: str) -> dict:
    """Train in this process (errors raise here); W&B runs go through `_run_fresh`."""
    return train_in_process([*TINY, *overrides], run_dir, cache_dir=data_cache)


def _run_fresh(overrides: list[str], run_dir: Path, data_cache: str) -> None:
    """`python -m dit_train ...` in a new process, as a user launches it."""
    from tests.conftest import run_cli

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    r = run_cli([*TINY, *overrides, f"data.cache_dir={data_cache}", f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr[-3000:]


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["run_id"]


# -- reading W&B's offline files back -----------------------------------------------------------
# A run-<id>.wandb file is W&B's transaction log: a 7-byte header (":W&B", magic, version), then
# LevelDB-log records (4-byte checksum, 2-byte length, 1-byte type: full / first / middle / last)
# in 32 KiB blocks, each holding one serialized wandb_internal_pb2.Record.


def _wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    block, head = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, b""
    while pos + head <= len(data):
        if block - pos % block < head:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + head])
        chunk = data[pos + head:pos + head + size]
        pos += head + size
        if kind == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_run(path: Path) -> tuple[object, dict[int, dict]]:
    """(the run record, the history: {step: {key: value or {field: value}}}) of one .wandb file."""
    run, history = None, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                keys = list(item.nested_key) or [item.key]
                value = json.loads(item.value_json)
                if len(keys) == 1:
                    row[keys[0]] = value
                else:
                    row.setdefault(keys[0], {})[keys[1]] = value
            history[row["_step"]] = row
    return run, history


def _offline_runs(run_dir: Path) -> list[Path]:
    """The .wandb file of each launch, oldest first."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def _tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return events


def _scalars(events, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


# -- the runs ------------------------------------------------------------------------------------


# One tracked launch on 2 workers serves the content tests, the rank-0 test and (copied) the
# resume test: each fresh W&B launch costs more than everything these tests check.
TRACKED = [*VALIDATION, *WANDB, "parallel.dp_shard=2", "train.ckpt_every=2", "train.keep_last=3"]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, data_cache) -> Path:
    pytest.importorskip("wandb")
    run = tmp_path_factory.mktemp("tracked") / "run"
    _run_fresh(TRACKED, run, data_cache)
    assert (run / "weights.safetensors").exists()  # the run finished
    return run


def test_wandb_offline_run_holds_the_config_metrics_grid_and_clips_in_the_run_folder(tracked_run):
    files = _offline_runs(tracked_run)
    assert len(files) == 1, files
    run, history = _wandb_run(files[0])
    run_id = _run_id(tracked_run)
    assert files[0].name == f"run-{run_id}.wandb"
    assert (run.run_id, run.display_name, run.project) == (run_id, "run", "dit_train")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["model"]["dim"] == 32 and config["train"]["loggers"] == ["tensorboard", "wandb"]
    rows = _rows(tracked_run)
    assert sorted(history) == [0, 1, 2]
    for step, row in rows.items():
        assert history[step]["train/loss"] == pytest.approx(row["loss"])
        assert history[step]["train/lr"] == pytest.approx(row["lr"])
    last = history[2]
    assert last["eval/palette_share"] == pytest.approx(rows[2]["eval/palette_share"])  # its group kept
    media = files[0].parent / "files"
    grid = last["samples/grid"]
    assert grid["_type"] == "image-file" and grid["format"] == "png"
    assert (media / grid["path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for key in ("sample_0", "sample_1"):
        video = last[f"samples/{key}"]
        assert video["_type"] == "video-file" and video["path"].endswith(".mp4")
        # the mp4 the run wrote, uploaded as it is
        written = tracked_run / "samples" / "step_000003" / f"{key}.mp4"
        assert (media / video["path"]).read_bytes() == written.read_bytes()


def test_tensorboard_still_gets_scalars_grid_and_gif_clips(tracked_run):
    events = _tensorboard(tracked_run)
    rows = _rows(tracked_run)
    assert _scalars(events, "train/loss") == [(s, pytest.approx(r["loss"])) for s, r in rows.items()]
    assert "eval/all_ok" in events.Tags()["scalars"] and "train/eval/all_ok" not in events.Tags()["scalars"]
    assert "train/step" not in events.Tags()["scalars"]
    grid, = events.Images("samples/grid")
    assert grid.step == 2 and grid.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
    for key in ("sample_0", "sample_1"):
        clip, = events.Images(f"samples/{key}")
        assert clip.step == 2 and clip.encoded_image_string[:6] == b"GIF89a"


def test_a_resumed_run_continues_the_same_wandb_run(tracked_run, tmp_path, data_cache):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tracked_run, run)  # the 3-step launch, resumed in a copy (the other tests read the original)
    run_id = _run_id(run)
    # from the checkpoint of step 1: step 2 is trained (and logged) a second time; on one process
    # (resuming onto another layout is exact, and one worker fewer to start)
    one_process = [o for o in TRACKED if o != "parallel.dp_shard=2"]
    _run_fresh([*one_process, "train.steps=5", f"train.resume={run / 'checkpoints' / 'step_00000001'}"], run, data_cache)
    assert _run_id(run) == run_id
    first, second = (_wandb_run(f) for f in _offline_runs(run))
    assert first[0].run_id == second[0].run_id == run_id  # one W&B run, a file per launch
    assert sorted(first[1]) == [0, 1, 2] and sorted(second[1]) == [2, 3, 4]
    rows = _rows(run)
    assert [second[1][s]["train/loss"] for s in (2, 3, 4)] == [pytest.approx(rows[s]["loss"]) for s in (2, 3, 4)]
    # TensorBoard hides the interrupted launch's step 2 (purge_step): each step once
    events = _tensorboard(run)
    assert _scalars(events, "train/loss") == [(s, pytest.approx(r["loss"])) for s, r in rows.items()]


def test_an_unknown_logger_is_refused_before_anything_runs(tmp_path, data_cache):
    from dit_train.config.errors import ConfigError

    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        _run(["train.loggers=[tensorboard,mlflow]"], run, data_cache)
    assert "train.loggers: 'mlflow' is not a tracker; allowed: tensorboard, wandb" in str(err.value)
    assert not run.exists()


def test_logger_checks_name_a_missing_package_and_a_repeated_name():
    from dit_train.trackers import TrackerSpec, tracker_errors

    spec = TrackerSpec("x", lambda run, cfg: None, package="no_such_package_for_dit_train", extra="x")
    assert spec.missing() == "pip install 'dit_train[x]' (or pip install no_such_package_for_dit_train)"
    assert TrackerSpec("tensorboard", lambda run, cfg: None).missing() is None
    assert tracker_errors(["tensorboard", "tensorboard"]) == ["train.loggers lists tensorboard more than once"]
    assert tracker_errors([]) == []


def test_wandb_auto_mode_is_online_only_with_credentials_and_a_server(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from dit_train.trackers import TrackedRun, wandb_tracker
    from dit_train.trackers.wandb_tracker import choose_mode

    assert choose_mode("auto", has_credentials=True, reachable=True) == "online"
    assert choose_mode("auto", has_credentials=True, reachable=False) == "offline"
    assert choose_mode("auto", has_credentials=False, reachable=True) == "offline"
    assert choose_mode("offline", has_credentials=True, reachable=True) == "offline"
    assert choose_mode("online", has_credentials=False, reachable=False) == "online"  # asked for: wandb says why not

    def no_probe(url):
        raise AssertionError("the server is only probed when there are credentials")

    monkeypatch.setattr(wandb_tracker, "_has_credentials", lambda: False)
    monkeypatch.setattr(wandb_tracker, "_reachable", no_probe)
    tracker = wandb_tracker.WandbTracker(TrackedRun(tmp_path, "autotest0001", 0, {}), "dit_train", "auto")
    try:
        assert tracker.mode == "offline" and tracker.run.settings.mode == "offline"
    finally:
        tracker.close()
    assert len(_offline_runs(tmp_path)) == 1


def test_wandb_that_cannot_start_names_the_way_out(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from dit_train.config.errors import ConfigError
    from dit_train.trackers import TrackedRun, wandb_tracker

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(ConfigError) as err:
        wandb_tracker.WandbTracker(TrackedRun(tmp_path, "nokey0000001", 0, {}), "dit_train", "online")
    msg = str(err.value)
    assert "No API key configured" in msg and "train.wandb_mode=offline" in msg and "wandb login" in msg, msg


@pytest.mark.slow
def test_only_rank_0_feeds_the_trackers(tracked_run):
    files = _offline_runs(tracked_run)  # the tracked run trains on 2 workers
    assert len(files) == 1 and len(list((tracked_run / "tb").glob("events.out.tfevents.*"))) == 1, files
    assert sorted(_wandb_run(files[0])[1]) == [0, 1, 2]
