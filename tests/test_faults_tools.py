"""The fault suite, tools that write what users keep (issue 43, "Data loss"): `tools.export_weights`
never replaces a file without --overwrite, never leaves half a file or a stray temporary one,
and never passes a damaged adapter file on; `tools.video_rl` never overwrites a run (its own
source least of all), and a stopped post-training run keeps what it did and resumes
(docs/checkpoints.md, "Faults and bad inputs tried")."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY, TINY_MODEL, train_in_process


def _one_error_line(capsys, *says: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(s in err for s in says), err
    return err


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def plain_run(tmp_path, tiny_cfg) -> Path:
    """A finished run as tools see it: config.yaml + weights.safetensors."""
    from dit_train.posttrain import TrainingSession

    run = tmp_path / "run"
    TrainingSession(tiny_cfg).export(run)
    return run


# -- export_weights: destinations -----------------------------------------------------------------


def test_export_refuses_to_replace_a_file_unless_overwrite(tmp_path, plain_run, capsys):
    """It replaced any existing --out file silently."""
    from dit_train.tools import export_weights

    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"a file the user keeps")
    assert export_weights.main([str(plain_run), "--out", str(mine)]) == 2
    _one_error_line(capsys, f"{mine} exists", "--overwrite")
    assert mine.read_bytes() == b"a file the user keeps"

    assert export_weights.main([str(plain_run), "--out", str(mine), "--overwrite"]) == 0
    a, b = load_file(mine), load_file(plain_run / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.safetensors", "run"]  # no temporary file left


def _fail_writes(monkeypatch, error: OSError, partial: bool) -> None:
    """safetensors' writer (under `save_file`, however it was imported) failing as on a full disk
    (after part of the file) or in a read-only folder (before writing anything): the tests may
    run as root, where chmod stops nothing."""
    import safetensors.torch

    def serialize_file(tensors, filename, metadata=None):
        if partial:
            Path(filename).write_bytes(b"\0" * 4096)
        raise error

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)


@pytest.mark.parametrize("case", ["onto_a_folder", "folder_is_a_file", "disk_full", "read_only", "disk_full_overwrite"])
def test_a_failed_export_is_one_line_and_leaves_nothing_behind(tmp_path, plain_run, capsys, monkeypatch, case):
    """--out onto a directory left a 6 MB `videos.tmp` and a traceback; a failing write left a
    half temporary file. Now: one line naming the file, and the folder exactly as before (an
    existing file replaced with --overwrite is still the old one)."""
    from dit_train.tools import export_weights

    out, says, flags = tmp_path / "w.safetensors", "could not write", []
    if case == "onto_a_folder":
        out, says = tmp_path / "videos", "is a folder"
        out.mkdir()
        (out / "clip.mp4").write_bytes(b"video")
    elif case == "folder_is_a_file":
        (tmp_path / "a_file").write_text("x")
        out, says = tmp_path / "a_file" / "w.safetensors", "is a file, not a folder"
    elif case == "read_only":
        _fail_writes(monkeypatch, PermissionError(errno.EACCES, "Permission denied"), partial=False)
    else:
        _fail_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"), partial=True)
        if case == "disk_full_overwrite":
            out.write_bytes(b"the old export")
            flags = ["--overwrite"]
    before = _tree(tmp_path)
    assert export_weights.main([str(plain_run), "--out", str(out), *flags]) == 2
    _one_error_line(capsys, str(out), says)
    assert _tree(tmp_path) == before


# -- export_weights: what it copies -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, data_cache) -> Path:
    """A LoRA run without checkpoints (the default train.ckpt_every=0): lora/ + weights.safetensors."""
    run = tmp_path_factory.mktemp("lora") / "run"
    train_in_process([*TINY, "model.lora.rank=4", "train.steps=1"], run, cache_dir=data_cache)
    return run


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no_tensors", "not_adapters"])
def test_a_damaged_adapter_file_is_refused_not_copied(tmp_path, lora_run, capsys, damage):
    """export_weights LORARUN --diffusers D copied a corrupt adapter file and exited 0."""
    import shutil

    from dit_train.tools import export_weights

    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    adapters = run / "lora" / "pytorch_lora_weights.safetensors"
    good = adapters.read_bytes()
    assert export_weights.main([str(run), "--diffusers", str(tmp_path / "ok")]) == 0  # the undamaged file passes
    assert (tmp_path / "ok" / adapters.name).read_bytes() == good
    if damage == "truncated":
        adapters.write_bytes(good[:len(good) // 2])
    elif damage == "garbage":
        adapters.write_bytes(b"\x00not a safetensors file at all")
    elif damage == "no_tensors":
        save_file({}, str(adapters))
    else:  # a readable file, but not adapters (the full weights copied over it)
        shutil.copyfile(run / "weights.safetensors", adapters)
    capsys.readouterr()
    assert export_weights.main([str(run), "--diffusers", str(tmp_path / "D")]) == 2
    _one_error_line(capsys, str(adapters), "checkpoints")
    assert not (tmp_path / "D").exists()


# -- video_rl: --out ------------------------------------------------------------------------------


@pytest.fixture
def rl_run(tmp_path, tiny_cfg) -> Path:
    """A trained run as video_rl takes it: config.yaml, weights.safetensors and EMA weights."""
    import dataclasses

    from dit_train.posttrain import TrainingSession

    run = tmp_path / "run"
    TrainingSession(dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, ema_decay=0.9))).export(run)
    assert (run / "weights_ema.safetensors").is_file()
    return run


RL = ["--captions", "1", "--group", "2", "--sample-steps", "1", "--eval-every", "0"]


def test_video_rl_never_overwrites_its_run_nor_a_folder_in_use(tmp_path, rl_run, capsys):
    """`video_rl RUN --out RUN` replaced the run's weights and config, and its old
    weights_ema.safetensors stayed, so tools.sample went on sampling the old model."""
    from dit_train.checkpoint.export import run_weights
    from dit_train.tools.video_rl import main

    before = _tree(rl_run)
    for out, flags, says in ((rl_run, [], "is the run it starts from"),
                             (rl_run, ["--overwrite"], "is the run it starts from"),
                             (tmp_path, ["--overwrite"], f"holds the run it starts from ({rl_run})")):
        assert main([str(rl_run), *RL, "--steps", "1", "--out", str(out), *flags]) == 2
        _one_error_line(capsys, f"--out {out}", "give another --out")
    assert _tree(rl_run) == before

    used = tmp_path / "used"  # a folder holding an earlier model, with EMA weights
    used.mkdir()
    for name in ("config.yaml", "weights.safetensors", "weights_ema.safetensors"):
        (used / name).write_bytes((rl_run / name).read_bytes())
    assert main([str(rl_run), *RL, "--steps", "1", "--out", str(used)]) == 2
    _one_error_line(capsys, f"--out {used} is not empty", "--overwrite")
    assert _tree(used) == _tree(rl_run)

    assert main([str(rl_run), *RL, "--steps", "1", "--out", str(used), "--overwrite"]) == 0
    assert not (used / "weights_ema.safetensors").exists()  # nothing stale passes for the new model
    assert run_weights(used, None)[1] == "weights.safetensors"
    (aside,) = used.glob("overwritten_*")  # moved aside, not lost
    assert _tree(aside) == before


def test_video_rl_refuses_an_out_another_process_holds(tmp_path, rl_run, capsys):
    """tools.video_rl took no lock on --out: a second one with --overwrite (or --resume) moved a
    running one's files aside under it. Now it takes the trainer's run-folder lock: one line
    naming the holder, the folder untouched."""
    import fcntl

    from dit_train.tools.video_rl import main

    out = tmp_path / "out"
    assert main([str(rl_run), *RL, "--steps", "1", "--out", str(out)]) == 0
    holder = open(out / ".lock", "a+")  # now another process (a video_rl going on with --resume) holds it
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.truncate(0)
    holder.write("pid 4242 on another-host since 2026-01-01 00:00:00\n")
    holder.flush()
    try:
        before = _tree(out)
        capsys.readouterr()
        for flags in (["--overwrite"], ["--resume"]):
            assert main([str(rl_run), *RL, "--steps", "2", "--out", str(out), *flags]) == 2
            _one_error_line(capsys, f"{out} is in use by pid 4242 on another-host", "give another --out")
            assert _tree(out) == before
    finally:
        holder.close()
    assert main([str(rl_run), *RL, "--steps", "2", "--out", str(out), "--resume"]) == 0  # released: it goes on


def test_video_rl_resume_refuses_a_run_whose_weights_changed(tmp_path, rl_run, capsys):
    """--resume checked RUN's path, not its weights: a run trained on (or replaced) since went on
    from the new weights with the old optimizer state and reference. Now the weights it started
    from are fingerprinted in the checkpoint and a change is one line."""
    from dit_train.tools.video_rl import main

    out = tmp_path / "out"
    flags = [str(rl_run), *RL, "--out", str(out)]
    assert main([*flags, "--steps", "1"]) == 0
    ema = load_file(rl_run / "weights_ema.safetensors")
    save_file({k: v * 1.5 for k, v in ema.items()}, str(rl_run / "weights_ema.safetensors"))  # trained on since
    capsys.readouterr()
    before = _tree(out)
    assert main([*flags, "--steps", "2", "--resume"]) == 2
    _one_error_line(capsys, f"--resume: {out} was started from other weights of RUN", "weights_ema.safetensors",
                    "--overwrite")
    assert _tree(out).keys() == before.keys() and all(_tree(out)[k] == v for k, v in before.items() if k != ".lock")
    save_file(ema, str(rl_run / "weights_ema.safetensors"))  # the same weights again: it goes on
    assert main([*flags, "--steps", "2", "--resume"]) == 0


# -- video_rl: stopped, then resumed ----------------------------------------------------------------


STOP_AT: list = []  # [the reward's call (from 1) that fails, the exception] (empty: none)
SEEN: list[list[str]] = []  # the captions of each step the reward scored


def stopping_reward(clips, captions):
    """The shapes reward, failing on its STOP_AT[0]-th call with STOP_AT[1] (a SIGTERM by default)."""
    import signal

    from dit_train.engine.launch import Interrupted
    from dit_train.tools.video_rl import shapes_reward

    if STOP_AT:
        STOP_AT[0] -= 1
        if STOP_AT[0] == 0:
            raise STOP_AT[1] if len(STOP_AT) > 1 else Interrupted(signal.SIGTERM)
    SEEN.append(list(captions))
    return shapes_reward(clips, captions)


@pytest.mark.parametrize("recipe", [["--recipe", "nft"], ["--recipe", "nft", "--old-decay", "0.5"],
                                    ["--recipe", "raft", "--keep-min", "-1", "--raft-batch", "1"]],
                         ids=["nft", "nft_old_policy", "raft"])
def test_video_rl_stopped_keeps_its_progress_and_resumes_to_the_same_weights(tmp_path, rl_run, capsys, recipe):
    """SIGTERM at step 2 of 3 left an empty --out and nothing to resume from. Now the first step is
    kept (weights, config, video_rl.json, a checkpoint), and --resume takes steps 2 and 3 as an
    uninterrupted run does: the same captions (the sampler's RNG), raft's buffer and its draws."""
    import json
    import signal

    from dit_train.tools.video_rl import main

    flags = [str(rl_run), *RL, *recipe, "--reward", "tests.test_faults_tools:stopping_reward", "--steps", "3",
             "optim.lr=0.5"]  # TINY's SGD: steps that move the weights well above the test's tolerance
    SEEN.clear()
    assert main([*flags, "--out", str(tmp_path / "full")]) == 0
    seen, SEEN[:] = list(SEEN), []
    STOP_AT[:] = [2]
    try:
        assert main([*flags, "--out", str(tmp_path / "part")]) == 128 + signal.SIGTERM
    except KeyboardInterrupt:  # not pytest's own stop: the tool let the signal through, keeping nothing
        pytest.fail("the SIGTERM went through video_rl: nothing was kept")
    finally:
        STOP_AT.clear()
    _one_error_line(capsys, "video_rl was stopped by SIGTERM", f"{tmp_path / 'part'} keeps 1 of 3 steps", "--resume")
    record = json.loads((tmp_path / "part" / "video_rl.json").read_text())
    assert record["status"] == "interrupted" and record["step"] == 1 and record["stopped"] == "stopped by SIGTERM"
    assert (tmp_path / "part" / "config.yaml").is_file() and (tmp_path / "part" / "weights.safetensors").is_file()

    assert main([*flags, "--out", str(tmp_path / "part"), "--resume"]) == 0
    assert SEEN == seen and len({c for step in seen for c in step}) == 3  # each step's own caption, as uninterrupted
    assert json.loads((tmp_path / "part" / "video_rl.json").read_text())["status"] == "completed"
    start = load_file(rl_run / "weights_ema.safetensors")  # what video_rl starts from
    full, part = load_file(tmp_path / "full" / "weights.safetensors"), load_file(tmp_path / "part" / "weights.safetensors")
    moved = max(float((full[k] - start[k]).abs().max()) for k in full)
    apart = max(float((full[k] - part[k]).abs().max()) for k in full)
    assert full.keys() == part.keys() and moved > 1e-5 and apart <= 1e-3 * moved, (moved, apart)


def test_video_rl_rollout_captions_heldout_draws_only_the_heldout_compositions(tmp_path, rl_run, capsys):
    """--rollout-captions heldout: the reward alone teaches the 48 compositions no clip shows, so
    every rollout caption is one of them (the default draws none of them); more --captions than
    there are held-out captions is one error line before anything is built."""
    from dit_train.data_pipelines.synthetic_video import caption_split
    from dit_train.tools.video_rl import main

    pool, heldout = caption_split()
    flags = [str(rl_run), "--captions", "3", "--group", "2", "--sample-steps", "1", "--eval-every", "0",
             "--reward", "tests.test_faults_tools:stopping_reward", "--steps", "2"]
    for which, allowed in (("heldout", set(heldout)), ("reward", set(pool))):
        SEEN.clear()
        assert main([*flags, "--rollout-captions", which, "--out", str(tmp_path / which)]) == 0
        drawn = {c for step in SEEN for c in step}
        assert len(SEEN) == 2 and len(drawn) == 6 and drawn <= allowed, (which, drawn - allowed)
    capsys.readouterr()
    assert main([*flags, "--rollout-captions", "heldout", "--captions", "49", "--out", str(tmp_path / "many")]) == 2
    _one_error_line(capsys, "error: --captions=49 with --rollout-captions heldout: there are 48 held-out captions")


def test_video_rl_old_decay_is_refused_outside_nft_and_out_of_range(tmp_path, rl_run, capsys):
    """--old-decay is DiffusionNFT's old policy: with another recipe, or outside [0, 1), one error
    line before anything is built (--out stays empty)."""
    from dit_train.tools.video_rl import main

    for flags, why in ((["--recipe", "raft", "--old-decay", "0.9"], "--old-decay is DiffusionNFT's old policy: --recipe nft only"),
                       (["--old-decay", "1"], "--old-decay=1.0 must be in [0, 1)")):
        assert main([str(rl_run), *flags, "--out", str(tmp_path / "out")]) == 2
        _one_error_line(capsys, f"error: {why}")
        assert not (tmp_path / "out").exists()


def test_video_rl_failing_mid_run_keeps_the_steps_done(tmp_path, rl_run, capsys):
    """A reward that raises at step 2 lost step 1 with the rest; now it is kept, and said so."""
    import json

    from dit_train.tools.video_rl import main

    STOP_AT[:] = [2, ValueError("--reward broke on step 2")]
    try:
        assert main([str(rl_run), *RL, "--reward", "tests.test_faults_tools:stopping_reward", "--steps", "3",
                     "--out", str(tmp_path / "out")]) == 2
    finally:
        STOP_AT.clear()
    _one_error_line(capsys, "error: --reward broke on step 2; ", "keeps 1 of 3 steps", "--resume")
    record = json.loads((tmp_path / "out" / "video_rl.json").read_text())
    assert record["status"] == "failed" and record["step"] == 1 and "ValueError" in record["stopped"]


def test_sigterm_to_video_rl_keeps_its_steps_and_resume_goes_on(tmp_path, rl_run):
    """The real signal, to the command line tool (its handler is the trainer's interrupt_on_signals)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from dit_train.tools.video_rl import main

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "dit_train.tools.video_rl", str(rl_run), *RL, "--steps", "100000",
                             "--out", str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.count("\n") == 1 and err.startswith("error: video_rl was stopped by SIGTERM; ") and "--resume" in err, err
    record = json.loads((out / "video_rl.json").read_text())
    assert record["status"] == "interrupted" and record["step"] >= 2, record
    assert main([str(rl_run), *RL, "--steps", str(record["step"] + 1), "--out", str(out), "--resume"]) == 0
    record = json.loads((out / "video_rl.json").read_text())
    assert record["status"] == "completed" and record["step"] == record["steps"]


def never_returning_reward(clips, captions):
    """A reward stuck for good (a remote scorer that never answers)."""
    import threading

    threading.Event().wait()


def test_a_reward_that_never_returns_is_one_error_after_its_timeout(tmp_path, rl_run, capsys):
    """It hung tools.video_rl for good; --reward-timeout (default 600 s) ends it with one line."""
    import time

    from dit_train.tools.video_rl import main

    t0 = time.perf_counter()
    assert main([str(rl_run), *RL, "--reward", "tests.test_faults_tools:never_returning_reward", "--steps", "2",
                 "--reward-timeout", "0.5", "--out", str(tmp_path / "out")]) == 2
    assert time.perf_counter() - t0 < 120
    _one_error_line(capsys, "error: --reward tests.test_faults_tools:never_returning_reward gave no answer within 0.5 s "
                            "(--reward-timeout)")


def test_ctrl_c_in_cache_latents_is_one_line_saying_how_to_go_on(tmp_path, models, source, monkeypatch, capsys):
    """Ctrl-C while encoding was a traceback; the clips written stay and a rerun encodes the rest."""
    from dit_train.tools import cache_latents
    from tests.conftest import cache_args

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_latents, "run_rank", interrupted)
    out = tmp_path / "cache"
    assert cache_latents.main(cache_args(models, source, out, tmp_path / "c")) == 130
    _one_error_line(capsys, "error: cache_latents was stopped by SIGINT; the clips encoded so far are kept in",
                    "run the same command again to go on")


# -- tools.sample: a shards run whose shards moved ----------------------------------------------------


@pytest.mark.parametrize("kind", ["pixels", "latents"])
def test_sampling_prompts_of_a_shards_run_needs_no_shards(tmp_path, data_cache, request, capsys, kind):
    """`tools.sample --prompt` on a run trained on shards read the shard index (the set's kind and,
    for latents, the VAE and text encoder live there): once the shards moved, no prompt could be
    sampled. The run folder keeps what sampling needs (run.json, written when the run is claimed):
    the same samples as before the move; --data-captions reads the training clips, so it is one
    line saying where they were."""
    import json

    pytest.importorskip("webdataset")
    from dit_train.tools import sample
    from dit_train.tools.make_shards import main as make_shards

    if kind == "pixels":
        data = [o for o in TINY if o.startswith("data.")] + ["data=synthetic_video", f"data.cache_dir={data_cache}"]
        model, read = TINY_MODEL, ["data.max_frames=8", "data.resolution_buckets=[]", f"data.cache_dir={data_cache}"]
        size = ["--frames", "4", "--height", "32", "--width", "32"]
    else:
        pytest.importorskip("transformers")
        from tests.conftest import TEXT_DIM, Z_DIM

        data = ["data=latent_cache", f"data.root={request.getfixturevalue('cache')}"]
        model, read = [*TINY_MODEL, f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}", "model.patch_size=[1,2,2]"], []
        size = ["--frames", "5", "--height", "32", "--width", "32"]
    shards, run = tmp_path / "shards", tmp_path / "run"
    assert make_shards(["--out", str(shards), "--samples-per-shard", "4", "--no-progress", *data]) == 0
    train_in_process([*model, "data=shards", f"data.url={shards}", *read, "train.steps=1", "train.global_batch=3"], run)
    prompt = [str(run), "--prompt", "a red circle moving up and left on a navy background", *size, "--steps", "2"]
    assert sample.main([*prompt, "--out", str(tmp_path / "before")]) == 0
    if kind == "pixels":  # a tools.video_rl --out of the run keeps the run's record too
        from dit_train.tools.video_rl import main as video_rl

        assert video_rl([str(run), "--steps", "1", "--recipe", "sft", "--updates", "1", "--raft-batch", "2",
                         "--eval-every", "0", "--out", str(tmp_path / "rl")]) == 0
    shards.rename(tmp_path / "moved")
    capsys.readouterr()
    assert sample.main([*prompt, "--out", str(tmp_path / "after")]) == 0, capsys.readouterr().err
    if kind == "pixels":
        rl_prompt = [str(tmp_path / "rl"), *prompt[1:], "--out", str(tmp_path / "rl_after")]
        assert sample.main(rl_prompt) == 0, capsys.readouterr().err
    a, b = load_file(tmp_path / "before" / "samples.safetensors"), load_file(tmp_path / "after" / "samples.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert sample.main([str(run), "--data-captions", "2", "--steps", "1", "--out", str(tmp_path / "data")]) == 2
    _one_error_line(capsys, "--data-captions", f"data.url={shards}", "--prompt")
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, "data": {"kind": "latents"}}))  # hand-edited: no meta
    assert sample.main([*prompt, "--out", str(tmp_path / "forged")]) == 2
    _one_error_line(capsys, "run.json records its shards", "not a record dit_train writes")
