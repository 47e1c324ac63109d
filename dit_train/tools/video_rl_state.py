"""What `tools.video_rl` keeps in its --out folder, and how a stopped run goes on (--resume).

--out holds the policy so far (weights.safetensors + config.yaml: what tools.sample and
generate.load_run read), the held-out figures (heldout.jsonl, heldout_step_XXXX.png), a status
record (video_rl.json: running / interrupted / completed, the step reached, how to go on) and
the newest checkpoint, resume/checkpoints/step_XXXXXXXX (numbered by video_rl step): the
session's own parts (weights, optimizer, LR schedule, counters, per-rank torch RNG) plus the
loop's state (`Progress`: the caption sampler's RNG, the session's optimizer-step count, raft's
buffer of accepted clips and its RNG, the sft baseline's RNG) and the flags that shape the
trajectory. It sits under resume/, not checkpoints/, so that tools taking --out as a run
(export_weights first) read its exported weights as before: a LoRA run's checkpoint holds only
adapters, whose base is the source run's weights. Everything random in a step is a function of
that state and the step (rollout noise ids are step * 10^4 + i), so a resumed run takes the same
steps as one never stopped.

The --out rules (`check_out`, before anything is built): --out is never the source run nor a
folder holding it; a folder that is not empty is refused unless --overwrite (its entries move to
--out/overwritten_<time>/, so no stale weights_ema.safetensors is taken for the new model) or
--resume (continue the run it holds, with the same trajectory flags, from the same weights of
RUN: their digest is in each checkpoint); one process at a time holds --out's lock (the
trainer's run-folder lock, `.lock`), from before anything in it is read or moved to the end.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dit_train.atomic import write_atomic
from dit_train.checkpoint import find_checkpoint, load_checkpoint, read_checkpoint_info, save_checkpoint
from dit_train.checkpoint.export import weights_source
from dit_train.config import to_yaml
from dit_train.config.errors import ConfigError
from dit_train.engine.run_folder import LOCK, data_record_of, lock_folder, move_aside

PROGRESS = "video_rl.json"
RESUME = "resume"  # --out/resume/checkpoints/step_XXXXXXXX
# the flags a resumed run must repeat: they decide which clips are sampled and how they train
# (--steps may grow; --eval-every, --max-minutes, --max-cpu-s, --ckpt-every may change)
TRAJECTORY = ("recipe", "reward", "captions", "group", "sample_steps", "kl", "keep_min", "updates", "raft_batch",
              "raft_select", "raft_min_buffer", "rollout_guidance", "rollout_captions", "old_decay")
# flags added after checkpoints were written: what those checkpoints ran with
TRAJECTORY_DEFAULTS = {"rollout_captions": "reward", "old_decay": 0.0}
# overrides that change the layout or the launcher, not the result (the layouts give the same steps)
LAYOUT_KEYS = ("parallel.", "launcher.")


def _rng_json(rng: random.Random) -> list:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _rng_set(rng: random.Random, saved: list) -> None:
    rng.setstate((saved[0], tuple(saved[1]), saved[2]))


@dataclass
class Progress:
    """The loop's state at a step boundary (what a stop saves): `step` video_rl steps done."""

    step: int
    session_step: int
    captions_rng: list
    buffer_rng: list
    buffer_added: int
    buffer: list[tuple[torch.Tensor, str]] = field(default_factory=list)  # raft's (clip [3, F, H, W], caption)
    data_rng: list | None = None

    @classmethod
    def capture(cls, step: int, session: Any, rng: random.Random, buffer: Any, data: Any) -> "Progress":
        return cls(step, session.step_count, _rng_json(rng), _rng_json(buffer.rng), buffer.added, list(buffer.clips),
                   _rng_json(data.rng) if data is not None else None)

    def to_json(self, settings: dict) -> dict:
        return {"step": self.step, "session_step": self.session_step, "captions_rng": self.captions_rng,
                "buffer_rng": self.buffer_rng, "buffer_added": self.buffer_added,
                "buffer_captions": [c for _, c in self.buffer],
                "buffer_shape": list(self.buffer[0][0].shape) if self.buffer else [], "data_rng": self.data_rng,
                "settings": settings}


class _JSONPart:
    """The loop's state in trainer.json (a small part: rank 0 writes it)."""

    sharded, optional = False, False

    def __init__(self, state: dict | None = None):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


class _ClipsPart:
    """raft's buffered clips, [N, 3, F, H, W], through DCP (the same on every rank)."""

    sharded, optional = True, False

    def __init__(self, clips: torch.Tensor):
        self.clips = clips

    def state_dict(self) -> dict:
        return {"clips": self.clips}

    def load_state_dict(self, state: dict) -> None:
        self.clips = state["clips"]


def trajectory(args: Any) -> dict:
    """The flags and overrides a resumed run must repeat (see TRAJECTORY)."""
    return {**{k: getattr(args, k) for k in TRAJECTORY},
            "overrides": [o for o in args.overrides if not o.lstrip("+~").startswith(LAYOUT_KEYS)]}


def read_progress(out: Path) -> dict | None:
    try:
        return json.loads((out / PROGRESS).read_text())
    except (OSError, ValueError):
        return None


def write_progress(out: Path, record: dict) -> None:
    write_atomic(out / PROGRESS, lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))


def source_weights(run: Path) -> str:
    """The weights of RUN the post-training starts from (what run_weights reads: the EMA weights
    when it has them) and a digest of their bytes, kept in each checkpoint: a --resume onto a RUN
    whose weights changed since (trained on, replaced) is refused. FileNotFoundError without any."""
    source = weights_source(run, None)
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return f"{source.name} sha256:{digest.hexdigest()[:16]}"


def check_out(run: Path, out: Path, args: Any) -> tuple[dict | None, Any]:
    """Refuse an --out that would lose work (module doc), before anything is built; then hold
    --out's lock (the trainer's run-folder lock: one process at a time) and, with --overwrite,
    move what it holds aside. Returns (the checkpoint's saved loop state with --resume, else
    None; the lock, held until it is closed)."""
    src, dst = run.resolve(), out.resolve()
    if src == dst or src.is_relative_to(dst):
        what = "is the run it starts from" if src == dst else f"holds the run it starts from ({run})"
        raise ConfigError(f"--out {out} {what}: its weights and config would be replaced; give another --out")
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --out, --overwrite starts it over: give one of them")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder")
    entries = sorted(p.name for p in out.iterdir() if p.name != LOCK) if out.is_dir() else []
    if args.resume and not (out / RESUME).is_dir():
        raise ConfigError(_NOTHING_TO_RESUME.format(out=out))
    if entries and not args.resume and not args.overwrite:
        record = read_progress(out)
        held = (f"a video_rl run, {record.get('status')} at step {record.get('step')} of {record.get('steps')}"
                if record else ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else ""))
        raise ConfigError(f"--out {out} is not empty ({held}): {'continue it with --resume, ' if record else ''}pass "
                          f"--overwrite to start over (what it holds moves to {out}/overwritten_<time>/), or give "
                          f"another --out")
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_folder(out, "give another --out")  # before anything in it is read or moved
    try:
        if args.resume:
            return _resumable(run, out, args), lock
        moving = [e for e in entries if not e.startswith("overwritten_")]
        if moving:
            print(f"--overwrite: moved {', '.join(moving)} to {move_aside(out, moving)}", flush=True)
        return None, lock
    except BaseException:
        lock.close()
        raise


_NOTHING_TO_RESUME = ("--resume: {out} holds no video_rl checkpoint to continue from (it was stopped before its first "
                      "one, or is not a video_rl --out); start over with --overwrite")


def _resumable(run: Path, out: Path, args: Any) -> dict:
    """--resume: the newest checkpoint's loop state, after checking that it continues this run
    with the same trajectory flags."""
    ckpt = find_checkpoint(out / RESUME)
    if ckpt is None:
        raise ConfigError(_NOTHING_TO_RESUME.format(out=out))
    state = read_checkpoint_info(ckpt)["parts"].get("video_rl")
    if not isinstance(state, dict) or "settings" not in state:
        raise ConfigError(f"--resume: {ckpt} is not a video_rl checkpoint (no video_rl state in its trainer.json)")
    saved, now = state["settings"], {**trajectory(args), "source": str(run.resolve())}
    for key, value in now.items():
        if saved.get(key, TRAJECTORY_DEFAULTS.get(key)) != value:
            flag = "RUN" if key == "source" else "overrides" if key == "overrides" else "--" + key.replace("_", "-")
            raise ConfigError(f"--resume: {out} was started with {flag} {saved.get(key)!r}, now {value!r}; resume "
                              f"with the same {flag}, or start over with --overwrite")
    return {**state, "checkpoint": str(ckpt)}


def check_source_weights(saved: dict | None, weights: str, run: Path, out: Path) -> None:
    """--resume (`saved`: check_out's loop state): RUN's weights must be those the run started from
    (`weights`: source_weights(run) now; checkpoints from before the digest was kept pass)."""
    started = (saved or {}).get("settings", {}).get("source_weights", weights)
    if started != weights:
        raise ConfigError(f"--resume: {out} was started from other weights of RUN {run} ({started}, now {weights}): "
                          f"they changed since (trained on or replaced); resume onto the weights it started from, or "
                          f"start over with --overwrite")


def keep_data_record(run: Path, out: Path) -> None:
    """--out keeps what RUN's folder kept of its data (run.json's "data"): `tools.sample --prompt`
    on --out then needs no data, as on RUN (a shards run's shards may move)."""
    record = data_record_of(run)
    if record:
        text = json.dumps({"data": record}, indent=2)
        write_atomic(out / "run.json", lambda tmp: tmp.write_text(text))


def save_state(session: Any, out: Path, snap: Progress, settings: dict) -> Path:
    """Checkpoint of the state at `snap` (every rank: a collective) and the policy's weights +
    config; keeps only the newest checkpoint. Returns its folder."""
    parts = {**session.run.checkpoint_parts(), "video_rl": _JSONPart(snap.to_json(settings))}
    if snap.buffer:
        parts["raft_buffer"] = _ClipsPart(torch.stack([c for c, _ in snap.buffer]))
    ckpt = save_checkpoint(out / RESUME, snap.step, parts, to_yaml(session.cfg), keep_last=1)
    session.export(out)
    return ckpt


def restore_state(session: Any, saved: dict, rng: random.Random, buffer: Any, data: Any) -> int:
    """Load the checkpoint `check_out` found into the session and the loop's objects (every
    rank). Returns the video_rl steps it had done."""
    parts = {**session.run.checkpoint_parts(), "video_rl": _JSONPart()}
    captions = saved["buffer_captions"]
    if captions:
        parts["raft_buffer"] = _ClipsPart(torch.zeros(len(captions), *saved["buffer_shape"]))
    step = load_checkpoint(Path(saved["checkpoint"]), parts)
    session.step_count = saved["session_step"]
    _rng_set(rng, saved["captions_rng"])
    _rng_set(buffer.rng, saved["buffer_rng"])
    buffer.added = saved["buffer_added"]
    buffer.clips = list(zip(parts["raft_buffer"].clips.unbind(0), captions)) if captions else []
    if data is not None and saved["data_rng"] is not None:
        _rng_set(data.rng, saved["data_rng"])
    return step
