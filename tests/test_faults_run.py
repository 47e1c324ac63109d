"""The fault suite, continued (tests/test_faults.py): run-level faults and bad inputs of a
second pass (issue 28) — values out of range, runs that cannot learn or end non-finite,
unreadable inputs, refused runs that must write nothing, changed data on resume, signals.
Documented with the others in docs/checkpoints.md, "Faults and bad inputs tried"."""
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

from tests.conftest import TINY, compose_config, train_in_process
from tests.test_faults import _run, _steps


# -- values out of range --------------------------------------------------------------------------


# (overrides, what the one error line says): the values first, then their siblings
OUT_OF_RANGE = [
    (["launcher.heartbeat_timeout_s=-5"], "launcher.heartbeat_timeout_s=-5.0 must be >= 0 (0 = off)"),
    (["data.max_dropped_fraction=-0.1"], "data.max_dropped_fraction=-0.1 must be in [0, 1]"),
    (["model.lora.rank=-2"], "model.lora.rank=-2 must be >= 0 (0 = no adapters)"),
    (["optim.lr=inf"], "optim.lr=inf must be finite and > 0"),
    (["optim.lr=nan"], "optim.lr=nan must be finite and > 0"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["optim.eps=0"], "optim.eps=0.0 must be > 0"),
    (["optim.momentum=1"], "optim.momentum=1.0 must be in [0, 1)"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1 must be >= 0"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be in [0, 1]"),
    (["train.ema_decay=1"], "train.ema_decay=1.0 must be in [0, 1) (0 = off)"),
    (["train.log_every=0"], "train.log_every=0 must be >= 1"),
    (["parallel.timeout_s=0"], "parallel.timeout_s=0.0 must be > 0"),
    (["parallel.threads_per_worker=-1"], "parallel.threads_per_worker=-1 must be >= 0"),
    (["launcher.master_port=70000"], "launcher.master_port=70000 must be in [0, 65535]"),
    (["launcher.monitor_interval=0"], "launcher.monitor_interval=0.0 must be > 0"),
    (["loss.logit_std=0"], "loss.logit_std=0.0 must be > 0"),
    (["loss.logit_mean=nan"], "loss.logit_mean=nan must be a finite number"),
    (["model.mlp_ratio=0"], "model.mlp_ratio=0.0 must be > 0"),
    (["model.lora.dropout=1"], "model.lora.dropout=1.0 must be in [0, 1)"),
    (["model.lora.alpha=-1"], "model.lora.alpha=-1.0 must be >= 0"),
    (["data.num_workers=-1"], "data.num_workers=-1 must be >= 0"),
    (["data.max_frames=0"], "data.max_frames=0 must be >= 1"),
    (["data.fps=-1"], "data.fps=-1.0 must be >= 0"),
    (["mode=llm", "data.max_doc_tokens=0"], "data.max_doc_tokens=0 must be >= 1"),
    (["model.lora.rank=4", "model.lora.init=pissa"], "model.lora.init='pissa' must be default or gaussian"),
    (["model.lora.rank=4", "model.lora.targets=[attn.qkv,atn.proj]"],
     "model.lora.targets: 'atn.proj' matches no linear layer of model=dit (its layers end in"),
]


@pytest.mark.parametrize("overrides,message", OUT_OF_RANGE, ids=[" ".join(o) for o, _ in OUT_OF_RANGE])
def test_a_value_out_of_range_is_one_line_naming_the_key_and_its_range(overrides, message):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    base = [] if "mode=llm" in overrides else TINY  # TINY's keys are the video model's and data's
    with pytest.raises(ConfigError) as err:
        check_config(compose_config([*base, *overrides]))
    assert str(err.value).startswith(f"invalid configuration: {message}") and "\n" not in str(err.value), str(err.value)


def test_every_numeric_key_has_a_range_check():
    """Each int/float key of every model and source (MoE on, so its keys are checked), set to NaN
    or -10^9, is refused naming it: a new numeric key without a rule fails here."""
    import copy

    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from dit_train.engine.resume import flatten

    any_int = {"train.seed", "data.gen_seed"}  # every integer is a seed
    bases = [["model.moe.num_experts=4"], ["mode=llm"], ["model=wan_tiny"], ["data=video_folder", "data.root=x"],
             ["data=latent_cache", "data.root=x"], ["data=shards", "data.url=x"]]
    unchecked, seen = [], set(any_int)
    for base in bases:
        cfg = compose_config(base)
        for key, value in flatten(cfg).items():
            if key in seen or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            seen.add(key)
            bad, node = copy.deepcopy(cfg), None
            *path, leaf = key.split(".")
            node = bad
            for part in path:
                node = getattr(node, part)
            setattr(node, leaf, float("nan") if isinstance(value, float) else -10 ** 9)
            try:
                check_config(bad)
                unchecked.append(key)
            except ConfigError as err:
                if f"{key}=" not in str(err):
                    unchecked.append(key)
    assert len(seen) > 60 and not unchecked, unchecked


TOOL_FLAGS = [  # (tool, arguments, what the one error line says)
    ("plan", ["--world", "0"], "argument --world: 0 must be in [1, 131072]"),
    ("plan", ["--gpu-mem-gib", "-1"], "argument --gpu-mem-gib: -1 must be > 0"),
    ("plan", ["--smoke-steps", "0"], "argument --smoke-steps: 0 must be >= 1"),
    ("sample", ["RUN", "--prompt", "x", "--frames", "0"], "argument --frames: 0 must be >= 1 (1 = a still image)"),
    ("sample", ["RUN", "--prompt", "x", "--height", "-8"], "argument --height: -8 must be >= 1"),
    ("sample", ["RUN", "--prompt", "x", "--num", "0"], "argument --num: 0 must be >= 1"),
    ("sample", ["RUN", "--prompt", "x", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    ("generate", ["RUN", "--temperature", "0"], "argument --temperature: 0 must be > 0"),
    ("generate", ["RUN", "--top-k", "-1"], "argument --top-k: -1 must be >= 0 (0 = greedy)"),
    ("generate", ["RUN", "--max-new", "x"], "argument --max-new: 'x' is not an integer"),
    ("cache_latents", ["--out", "o", "--vae", "v", "--workers", "0"], "argument --workers: 0 must be >= 1"),
    ("verify_layouts", ["--steps", "0"], "argument --steps: 0 must be >= 1"),
    ("context_shift", ["--steps", "0"], "argument --steps: 0 must be >= 1"),
    ("score_shapes", ["--num-clips", "0"], "argument --num-clips: 0 must be >= 1"),
]


@pytest.mark.parametrize("tool,args,message", TOOL_FLAGS, ids=[f"{t} {' '.join(a)}" for t, a, _ in TOOL_FLAGS])
def test_a_tool_flag_out_of_range_is_one_line(tool, args, message, capsys):
    import importlib

    main = importlib.import_module(f"dit_train.tools.{tool}").main
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


# -- no non-finite success; runs that cannot learn ------------------------------------------------


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity (what JSON itself does not allow)."""
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_weights_turned_non_finite_fail_the_run_at_once_in_strict_json(tmp_path, data_cache, monkeypatch):
    """What optim.lr=1e30 does: an update leaves NaN in the weights, every later step is skipped.
    The run stops at the first skipped step (not with status completed and NaN weights)."""
    from dit_train.config.errors import NonFiniteTraining

    orig = torch.optim.SGD.step

    def step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.SGD, "step", step)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteTraining, match=r"step 1: the weights are no longer finite .*lower optim.lr \(now 0.5\)"):
        _run([*TINY, "train.steps=4"], run, data_cache)
    summary = _strict_json((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_done"] == 1 and summary["final_loss"] > 0
    rows = [_strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["loss"] is None and rows[1]["nonfinite"] and rows[1]["skipped"] == 1
    assert not (run / "weights.safetensors").exists()


def test_a_non_finite_final_loss_fails_the_run(tmp_path, data_cache, monkeypatch):
    from dit_train.engine.trainer import Trainer
    from dit_train.config.errors import NonFiniteTraining

    orig = Trainer.step

    def step(self, s):
        res = orig(self, s)
        if s == 1:
            res.loss = float("nan")
        return res

    monkeypatch.setattr(Trainer, "step", step)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteTraining, match="the last step's loss is nan"):
        _run([*TINY, "train.steps=2"], run, data_cache)
    summary = _strict_json((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["final_loss"] is None and summary["steps_done"] == 2


def test_lora_that_cannot_learn_is_refused_and_a_zero_gradient_is_named(tmp_path, data_cache, monkeypatch, caplog):
    from dit_train.config.errors import ConfigError

    lora = [*TINY, "model.init=adaln_zero", "model.lora.rank=4", "train.steps=1"]
    with pytest.raises(ConfigError, match=r"output head \(final.linear\) is all zero .*set model.init=normal"):
        _run(lora, tmp_path / "zero_head", data_cache)
    assert not (tmp_path / "zero_head" / "metrics.jsonl").exists()
    # adapters on the head itself do learn (through them, the rest does)
    _run([*lora, "model.lora.targets=[final.linear,attn.qkv]"], tmp_path / "head_adapted", data_cache)
    assert json.loads((tmp_path / "head_adapted" / "metrics.jsonl").read_text().splitlines()[0])["grad_norm"] > 0
    # any run whose first step has an exactly zero gradient says so
    from dit_train.tasks.video import VideoTask

    orig = VideoTask.per_token_loss
    monkeypatch.setattr(VideoTask, "per_token_loss", lambda self, *a: orig(self, *a) * 0.0)
    _run([*TINY, "train.steps=1"], tmp_path / "zero_loss", data_cache)
    assert "step 0: every trainable parameter got an exactly zero gradient" in caplog.text


# -- unreadable inputs: one line, no traceback ----------------------------------------------------


@pytest.mark.parametrize("text_path,message", [("missing.txt", r"missing\.txt: no such file"),
                                               ("/dev/zero", r"/dev/zero is a character device, not a file"),
                                               (".", r"is a folder, not a file")])
def test_an_unusable_corpus_is_one_line_before_anything_runs(tmp_path, text_path, message):
    """A missing corpus was a 27-line FileNotFoundError; /dev/zero was read whole (OOM-killed)."""
    from dit_train.config.errors import ConfigError

    path = text_path if text_path.startswith("/") else str(tmp_path / text_path)
    with pytest.raises(ConfigError, match=message):
        train_in_process(["mode=llm", f"data.text_path={path}", "train.steps=1"], tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _run_dir_with_weights(path: Path, overrides: list[str], weights: bytes) -> Path:
    """A run folder's config.yaml and a weights.safetensors holding `weights`, without training."""
    from dit_train.config import to_yaml

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(to_yaml(compose_config(overrides)))
    (path / "weights.safetensors").write_bytes(weights)
    return path


@pytest.mark.parametrize("tool,overrides,args", [("sample", TINY, ["--prompt", "x"]), ("generate", ["mode=llm"], [])])
def test_malformed_weights_are_one_line_naming_the_file(tmp_path, capsys, tool, overrides, args):
    import importlib

    run = _run_dir_with_weights(tmp_path / "run", overrides, b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}")
    assert importlib.import_module(f"dit_train.tools.{tool}").main([str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'weights.safetensors'} is not a readable .safetensors file") \
        and err.count("\n") == 1, err


def test_cache_latents_names_a_missing_model_folder(tmp_path, capsys):
    from dit_train.tools.cache_latents import main

    assert main(["--out", str(tmp_path / "out"), "--vae", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: --vae {tmp_path / 'missing'}: no such folder (a local diffusers / transformers folder, or a " \
                  f"pipeline folder; hub ids are not downloaded)\n"


def test_session_refuses_an_out_of_vocabulary_prompt_and_an_empty_datum():
    from dit_train.posttrain import Datum, TrainingSession

    sess = TrainingSession(compose_config(["mode=llm", "model.dim=32", "model.depth=1", "model.heads=2",
                                           "train.micro_batch_tokens=96", "data.max_doc_tokens=64"]))
    with pytest.raises(ValueError, match=r"prompt 1 holds id 300, outside \[0, model.vocab_size=256\)"):
        sess.generate([[72, 105], [300, 5]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 0 must be a non-empty list of token ids"):
        sess.generate([[]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"datum 0: tokens is empty; expected \[T\] integer token ids with T >= 2"):
        sess.forward_backward([Datum(tokens=[])])


# -- run folders, changed data, signals -----------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder` (its lock aside): content and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_a_refused_run_writes_nothing_and_an_unusable_run_dir_is_one_line(tmp_path, data_cache):
    """Hydra wrote .hydra/*.yaml (and opened its log) before our code ran, so a run refused on
    another run's folder overwrote that run's .hydra/ files. They are written once the folder
    is claimed; what was logged before the claim is kept for the log."""
    from tests.conftest import run_cli

    run = tmp_path / "run"
    args = [*TINY, "train.steps=1", f"data.cache_dir={data_cache}"]
    first = run_cli([*args, "train.resume=auto", f"hydra.run.dir={run}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "- train.steps=1" in (run / ".hydra" / "overrides.yaml").read_text()
    assert (run / ".hydra" / "config.yaml").is_file() and "output_subdir: null" in (run / ".hydra" / "hydra.yaml").read_text()
    assert "train.resume=auto: no checkpoint in" in (run / "__main__.log").read_text()  # logged before the claim
    before = _snapshot(run)
    refused = run_cli([*args, "train.seed=3", f"hydra.run.dir={run}"], tmp_path)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "holds another run's outputs" in refused.stderr
    assert _snapshot(run) == before
    (tmp_path / "a_file").write_text("x")
    bad = run_cli([*args, f"hydra.run.dir={tmp_path / 'a_file' / 'run'}"], tmp_path)
    assert bad.returncode == 1 and bad.stderr == (f"error: run folder {tmp_path / 'a_file' / 'run'} cannot be created: "
                                                  f"{tmp_path / 'a_file'} is a file, not a folder; pick another "
                                                  f"hydra.run.dir or fix its permissions\n"), bad.stderr


def test_resume_refuses_data_that_changed_unless_told(tmp_path, data_cache, caplog):
    """Clips removed from data.root change the step plan of the resumed steps: refused before
    anything is written, naming data.root and the counts; train.resume_data_changed=true goes on."""
    from dit_train.config.errors import RunFolderError
    from tests.conftest import TINY_MODEL
    from tests.test_video_folder import make_video_folder

    videos = make_video_folder(tmp_path / "videos", Path(data_cache), n=8)
    base = [*TINY_MODEL, "data=video_folder", f"data.root={videos}", "data.max_frames=8", "data.num_workers=0",
            "train.global_batch=3", "train.ckpt_every=2",
            "data.max_dropped_fraction=0.2"]  # the folder's corrupt file is 1 of 9 (above 0.05: refused)
    run = tmp_path / "run"
    _run([*base, "train.steps=2"], run, data_cache)
    (videos / "video_0.mp4").unlink()
    before = _snapshot(run)
    with pytest.raises(RunFolderError, match=rf"data.root={videos} changed since .*step_00000001: it had 8 samples, now 7"
                                             rf".*train.resume_data_changed=true"):
        _run([*base, "train.steps=3", "train.resume=auto"], run, data_cache)
    assert _snapshot(run) == before
    _run([*base, "train.steps=3", "train.resume=auto", "train.resume_data_changed=true"], run, data_cache)
    assert f"train.resume_data_changed=true: data.root={videos} changed" in caplog.text and _steps(run) == [0, 1, 2]


def test_resume_sees_clips_replaced_by_others_of_the_same_sizes(tmp_path, data_cache):
    """Every clip's content and caption replaced, then train.resume=auto: it resumed without a word
    (the fingerprint held the lengths only). The captions are in it now."""
    from dit_train.config.errors import RunFolderError
    from tests.conftest import TINY_MODEL
    from tests.test_video_folder import make_video_folder

    videos = make_video_folder(tmp_path / "videos", Path(data_cache), n=6)
    base = [*TINY_MODEL, "data=video_folder", f"data.root={videos}", "data.max_frames=8", "data.num_workers=0",
            "train.global_batch=3", "train.ckpt_every=2", "data.max_dropped_fraction=0.2"]  # the folder's corrupt clip
    run = tmp_path / "run"
    _run([*base, "train.steps=2"], run, data_cache)
    for i, clip in enumerate(sorted(videos.glob("*.mp4"))):
        clip.with_suffix(".txt").write_text(f"another clip altogether {i}")
    with pytest.raises(RunFolderError, match=r"it had 6 samples of the same lengths, now with other captions"):
        _run([*base, "train.steps=3", "train.resume=auto"], run, data_cache)


def _start(args: list[str], run: Path, cwd: Path, steps_seen: int = 1) -> subprocess.Popen:
    """`python -m dit_train` started, returned once `steps_seen` steps are in its metrics."""
    proc = subprocess.Popen([sys.executable, "-m", "dit_train", *args, f"hydra.run.dir={run}"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        m = run / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= steps_seen:
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the run never reached step {steps_seen}: {proc.communicate()[1][-3000:]}")


def _ended_like_ctrl_c(proc: subprocess.Popen, run: Path, signum: int) -> None:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signum, (proc.returncode, err[-3000:])
    assert err.count("\n") == 1 and err.startswith(f"error: the run was stopped by {signal.Signals(signum).name}"), err
    summary = _strict_json((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == f"Interrupted: stopped by {signal.Signals(signum).name}"
    assert summary["steps_done"] >= 1 and summary["final_loss"] is not None


def test_sigterm_ends_a_run_like_ctrl_c(tmp_path, data_cache):
    """It killed the process: no summary.json, no line saying what happened."""
    run = tmp_path / "run"
    proc = _start([*TINY, "train.steps=100000", f"data.cache_dir={data_cache}"], run, tmp_path, steps_seen=2)
    proc.send_signal(signal.SIGTERM)
    _ended_like_ctrl_c(proc, run, signal.SIGTERM)


def test_a_signal_swallowed_by_a_finalizer_still_stops_the_run(tmp_path, data_cache, monkeypatch):
    """A SIGTERM landing while a decord VideoReader's __del__ ran was printed as "Exception ignored
    in ... __del__" and lost: the run trained on (a scheduler sends one SIGTERM before SIGKILL).
    The signal is remembered and the next step raises it."""
    from dit_train.engine import launch

    monkeypatch.setattr(launch, "_pending", [])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        launch.interrupt_on_signals()

        class Reader:
            def __del__(self):  # the handler's raise lands in here, where Python can only print it
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)

        ignored = []  # what Python would print as "Exception ignored in ... __del__"
        monkeypatch.setattr(sys, "unraisablehook", ignored.append)
        Reader()  # dropped at once: __del__ runs
        assert not ignored  # the handler does not raise inside a finalizer (a traceback on stderr)
        with pytest.raises(launch.Interrupted) as err:
            launch.check_interrupted()
        assert err.value.signum == signal.SIGTERM
        # the training loop polls at every step: the run stops at its next step, interrupted
        run = tmp_path / "run"
        with pytest.raises(KeyboardInterrupt):
            train_in_process([*TINY, "train.steps=3"], run, data_cache)
        summary = _strict_json((run / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["steps_done"] == 0, summary
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_sigterm_to_the_launcher_of_local_workers_ends_like_ctrl_c(tmp_path, data_cache):
    """torch elastic turned it into a Hydra traceback and the workers died without summary.json."""
    from tests.test_checkpoint import _workers

    run = tmp_path / "run"
    proc = _start([*TINY, "train.steps=100000", "parallel.dp_shard=2", f"data.cache_dir={data_cache}"], run, tmp_path,
                  steps_seen=2)
    victims = _workers(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _ended_like_ctrl_c(proc, run, signal.SIGTERM)
    # the workers end as the launcher does; a loaded machine may take a few seconds to reap them
    deadline = time.time() + 15
    while [v for v in victims if _alive(v)] and time.time() < deadline:
        time.sleep(0.2)
    assert victims and not [v for v in victims if _alive(v)], "orphaned worker processes"


def _alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its reaper has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- advice ---------------------------------------------------------------------------------------


def test_advice_says_only_what_applies(tmp_path, caplog):
    """The hint to enable clipping when it is on; 'quality against the prompts:' with nothing
    after it; 'put back data.root=<absent>'; a long prompt cut to model.text_len in silence."""
    from dit_train.engine.resume import config_changes
    from dit_train.engine.sanity import nonfinite_hint
    from dit_train.sampling.prompts import prompt_space
    from dit_train.tools.sample import quality_line

    clipped, unclipped = compose_config(["optim.max_grad_norm=1"]), compose_config(["optim.max_grad_norm=0"])
    assert "clipping" not in nonfinite_hint(clipped.optim, clipped.train)
    assert "enable clipping (optim.max_grad_norm=1)" in nonfinite_hint(unclipped.optim, unclipped.train)
    assert quality_line({"eval/num_clips": 0.0, "eval/num_skipped": 1.0}).startswith(
        "quality against the prompts: not scored (no prompt is a caption of the shapes world")
    assert quality_line({"eval/all_ok": 0.5, "eval/num_clips": 2.0}) == "quality against the prompts: all_ok=0.50"
    assert quality_line({}) == ""
    lines = [c.line() for c in config_changes(compose_config([]), compose_config(["data=video_folder", "data.root=v"]))]
    assert not [x for x in lines if "<absent>" in x] and any(x.startswith("data.root: the checkpoint's data has no such "
                                                                          "key") for x in lines), lines
    assert any("put back data.name=synthetic_video" in x for x in lines)
    space = prompt_space(compose_config(["model.text_dim=8", "model.text_len=64"]))
    assert space.encode("x" * 10_000).shape[0] == 64
    assert "is 10000 bytes long; the model reads the first 64 (model.text_len=64)" in caplog.text


def test_a_worker_stopped_from_outside_is_named_by_its_signal_not_elastics_url():
    """SIGTERM to one worker ended with "worker rank 1 failed (exit code 143): To enable traceback
    see: https://pytorch.org/docs/stable/elastic/errors.html"."""
    from dit_train.engine.launch import failure_line

    elastic = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert failure_line(1, 143, elastic) == ("worker rank 1 was stopped by SIGTERM from outside the run (a scheduler, "
                                             "the out-of-memory killer or kill; exit code 143); all workers were stopped")
    assert failure_line(0, -9, "Signal 9 (SIGKILL) received by PID 27929").startswith(
        "worker rank 0 was stopped by SIGKILL from outside the run")
    assert failure_line(2, 1, "ValueError: boom") == "worker rank 2 failed (exit code 1): ValueError: boom"
    assert failure_line(2, 1, elastic) == "worker rank 2 failed (exit code 1): see the traceback above"


def test_a_full_disk_at_the_final_weights_is_one_line_saying_where_they_still_are(tmp_path, data_cache, monkeypatch):
    """ENOSPC while writing weights.safetensors at the end was a traceback (an OSError no handler
    took): now RunFailed naming the folder and the export command, summary.json status failed."""
    import errno

    from dit_train.config.errors import RunFailed

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("dit_train.checkpoint.export.save_file_atomic", full)
    run = tmp_path / "run"
    with pytest.raises(RunFailed, match=r"the final weights could not be written into .*No space left on device.*"
                                        r"tools.export_weights"):
        train_in_process([*TINY, "train.steps=2", "train.ckpt_every=2"], run, data_cache)
    assert _strict_json((run / "summary.json").read_text())["status"] == "failed"
    assert not list(run.glob("weights*.safetensors*"))  # no half file, no stray temporary
