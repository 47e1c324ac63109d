"""A run folder you can trust: one run per folder, checked before anything is written.

`open_run_folder` runs once per launch, in the process that starts the workers (or on rank 0
under torchrun / SLURM), before any step:

1. the folder and its checkpoint folder are writable, and the free space covers the
   checkpoints the run will keep (estimated from the model's size; the `.step_*.tmp` folders
   of interrupted saves count as free, and are removed once the run is accepted);
2. a lock (`.lock`, an OS file lock: a dead process holds none) says one run at a time;
3. a folder holding another run's outputs is refused unless `train.resume` continues it or
   `train.overwrite=true` moves the old outputs aside (`overwritten_<time>/`: nothing is lost);
4. resuming: every config key that changed since the checkpoint is classified (resume.py),
   and the data must still hold the samples the checkpoint's step plan was made from (its
   count and lengths) unless `train.resume_data_changed=true`; a refusal stops here, before
   anything is written;
5. the config is recorded: `config.yaml` for a new run, `resume_<step>.yaml` for each resumed
   segment (never overwritten), `run.json` holds the run's id (checkpoints carry it, and
   pruning only removes this run's own) and what sampling needs to know of the data beyond the
   config (`DataSource.run_record`: a shard set's kind and a latent set's VAE and text encoder,
   so `tools.sample --prompt` works once the data moved), and Hydra's `.hydra/` files and job log
   (hydra_outputs.py) are written now, not before the folder was ours.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_train.checkpoint import checkpoint_root, read_checkpoint_info, resolve_checkpoint
from dit_train.compose import load_config
from dit_train.config import to_yaml
from dit_train.config.errors import RunFolderError
from dit_train.data_pipelines import data_location, source_for
from dit_train.engine.resume import config_changes, refusal_message
from dit_train.perf.memory import model_shape, optimizer_bytes_per_param

log = logging.getLogger(__name__)

LOCK = ".lock"  # the folder's lock file (lock_folder): held by the running process, left behind after it
# what a finished or running training leaves in its folder (Hydra's own .hydra/ and logs don't count)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "wandb", "samples", "weights.safetensors",
               "weights_ema.safetensors", "summary.json", "config.yaml", "run.json", "lora", "lora_ema")


@dataclass
class RunFolder:
    path: Path
    run_id: str
    resume_from: Path | None  # the checkpoint this launch continues from
    lock: Any = None  # the open lock file (released when the process exits)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None


def run_id_of(run_dir: str | Path) -> str | None:
    p = Path(run_dir) / "run.json"
    return json.loads(p.read_text()).get("run_id") if p.is_file() else None


def data_record_of(run_dir: str | Path) -> dict:
    """What the run folder kept of its data for sampling (run.json's "data"; {} for a folder
    without one: an export, an older run). ValueError naming the file when it is not a record."""
    p = Path(run_dir) / "run.json"
    if not p.is_file():
        return {}
    try:
        record = json.loads(p.read_text()).get("data", {})
    except (ValueError, AttributeError, OSError) as err:
        raise ValueError(f"{p} is not a run record dit_train wrote ({err}); remove it to sample without it") from None
    if not isinstance(record, dict):
        raise ValueError(f"{p}: its \"data\" is not a record dit_train writes; remove it to sample without it")
    return record


def _writable(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as err:
        raise RunFolderError(f"{what} {path} is not writable ({err.strerror}); pick another hydra.run.dir "
                             f"or fix its permissions") from None


def lock_folder(path: Path, instead: str = "pick another hydra.run.dir") -> Any:
    """Hold `path`'s lock (LOCK, an OS file lock: a dead process holds none) for as long as the
    returned file stays open; RunFolderError naming the holder, and `instead` as the other way
    out, while another process holds it (a training run, `tools.video_rl` on its --out)."""
    f = open(path / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunFolderError(f"run folder {path} is in use by {holder}; wait for it to finish or {instead}") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def previous_outputs(path: Path) -> list[str]:
    """What an earlier run left here (empty folders, e.g. a checkpoint folder this check made, don't count)."""
    def there(name: str) -> bool:
        p = path / name
        return p.is_file() or (p.is_dir() and any(p.iterdir()))

    return [name for name in RUN_OUTPUTS if there(name)]


def move_aside(path: Path, names: list[str]) -> Path:
    """Move path/<name> for each name into a new path/overwritten_<time>/ (returned): what an
    overwrite replaces is kept, where no tool takes it for the new run's outputs."""
    dest = path / f"overwritten_{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir()
    # with the old run's Hydra record and job log (hydra_outputs.py), which the new run writes anew
    extra = [p.name for p in [*path.glob("resume_*.yaml"), *path.glob("*.log"), path / ".hydra"]
             if p.exists() and p.name not in names]
    for name in names + extra:
        os.replace(path / name, dest / name)
    return dest


def checkpoint_bytes(cfg: Any) -> float:
    """Estimated size of one checkpoint: fp32 weights, optimizer state, EMA."""
    params = model_shape(cfg.model).params
    per_param = 4 + optimizer_bytes_per_param(cfg.optim.name, cfg.optim.momentum) + (4 if cfg.train.ema_decay > 0 else 0)
    return params * per_param


def interrupted_saves(path: Path) -> list[Path]:
    """`checkpoints/.step_*.tmp` of saves a crash or a failure interrupted: never a save in
    progress, since the caller holds the folder's lock."""
    root = path / "checkpoints"
    return sorted(root.glob(".step_*.tmp")) if root.is_dir() else []


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _space(path: Path, cfg: Any, leftovers: list[Path]) -> None:
    """Free space for the checkpoints the run keeps; interrupted saves count as free (they are
    removed before the run starts)."""
    if cfg.train.ckpt_every <= 0:
        return
    need = checkpoint_bytes(cfg) * (cfg.train.keep_last + 1) * 1.1  # keep_last + the one being written
    free = shutil.disk_usage(path).free + sum(_bytes(t) for t in leftovers)
    if free < need:
        raise RunFolderError(f"{path} has {free / 2**30:.2f} GiB free but keeping {cfg.train.keep_last} checkpoints "
                             f"needs ~{need / 2**30:.2f} GiB; free space, lower train.keep_last or train.ckpt_every=0")


def check_same_data(ckpt: Path, data: dict[str, Any] | None, cfg: Any) -> None:
    """Refuse to resume `ckpt` on data whose fingerprint (packing.data_fingerprint: sample count,
    lengths, captions) differs from the one it was trained on, unless train.resume_data_changed.
    Checkpoints without a fingerprint (older ones) and callers without data pass."""
    saved = read_checkpoint_info(ckpt)["parts"].get("trainer", {}).get("data")
    # keys both have: a checkpoint from before captions were fingerprinted compares lengths only
    if data is None or not saved or all(saved[k] == data[k] for k in saved if k in data):
        return
    n0, n1 = saved.get("samples"), data["samples"]
    if n0 != n1:
        what = f"{n0} samples, now {n1}"
    elif saved.get("lengths_sha256") != data.get("lengths_sha256"):
        what = f"{n0} samples, now {n1} of other lengths"
    else:
        what = f"{n0} samples of the same lengths, now with other captions (other clips)"
    if cfg.train.resume_data_changed:
        log.warning("train.resume_data_changed=true: %s changed since %s (%s); the steps from the resumed one on "
                    "draw from the new data", data_location(cfg.data), ckpt.name, what)
        return
    raise RunFolderError(f"{data_location(cfg.data)} changed since {ckpt}: it had {what}, so the resumed steps would draw "
                         f"other samples than the run did; put the data back, start a new run folder "
                         f"(hydra.run.dir=...), or continue on the new data with train.resume_data_changed=true")


def open_run_folder(cfg: Any, resume: str, hydra_record: Any = None, data: dict[str, Any] | None = None) -> RunFolder:
    """Check and claim `cfg.run_dir` for this launch (see the module docstring).

    hydra_record: a `HydraRecord` to write once the folder is claimed (None outside the CLI).
    data: the fingerprint of the configured data (packing.data_fingerprint) to compare
    with a resumed checkpoint's; None = not checked."""
    path = Path(cfg.run_dir)
    record = source_for(cfg.data, cfg.model).run_record()  # (the data was read already: checked_data)
    _writable(path, "run folder")
    if cfg.train.ckpt_every > 0:
        _writable(checkpoint_root(path), "checkpoint folder")
    lock = lock_folder(path)
    try:
        try:
            ckpt = resolve_checkpoint(resume, path)
        except FileNotFoundError as err:
            raise RunFolderError(str(err)) from None
        found = previous_outputs(path)
        if resume == "auto" and ckpt is None and not found:
            log.warning("train.resume=auto: no checkpoint in %s, starting from step 0", checkpoint_root(path))
        if ckpt is None and found:
            if resume == "auto" and not cfg.train.overwrite:  # it was told to continue: say why it cannot
                raise RunFolderError(
                    f"train.resume=auto: run folder {path} holds a run's outputs ({', '.join(found)}) but no checkpoint "
                    f"to continue from (it stopped before its first one; train.ckpt_every={cfg.train.ckpt_every}); "
                    f"start it again with train.overwrite=true (moves them to {path}/overwritten_<time>/) or pick "
                    f"another hydra.run.dir")
            if not cfg.train.overwrite:
                raise RunFolderError(
                    f"run folder {path} holds another run's outputs ({', '.join(found)}); continue it with "
                    f"train.resume=auto, pick another hydra.run.dir, or set train.overwrite=true (moves them to "
                    f"{path}/overwritten_<time>/)")
            log.warning("train.overwrite=true: moved %s to %s", ", ".join(found), move_aside(path, found))
        if ckpt is not None:
            changes = config_changes(load_config(ckpt), cfg)
            refused = [c for c in changes if c.kind == "refused"]
            if refused:
                raise RunFolderError(refusal_message(ckpt, refused))
            for c in changes:
                if c.kind == "notice":
                    log.warning("resume: %s", c.line())
            check_same_data(ckpt, data, cfg)
        leftovers = interrupted_saves(path)
        _space(path, cfg, leftovers)
    except BaseException:
        lock.close()
        raise
    for tmp in leftovers:
        log.warning("removing %s: a checkpoint save that was interrupted (it never became a checkpoint)", tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    same_folder = ckpt is not None and ckpt.parent.parent.resolve() == path.resolve()
    run_id = (run_id_of(path) if same_folder else None) or (read_checkpoint_info(ckpt).get("run_id") if ckpt else None) \
        or uuid.uuid4().hex[:12]
    config_yaml = to_yaml(cfg)  # once: OmegaConf's structured copy of the tree, ~0.07 CPU-s
    if ckpt is None:
        (path / "config.yaml").write_text(config_yaml)
    else:
        step = read_checkpoint_info(ckpt)["step"] + 1
        (path / f"resume_{step:08d}.yaml").write_text(config_yaml)
        if not (path / "config.yaml").exists():
            (path / "config.yaml").write_text(config_yaml)
    (path / "run.json").write_text(json.dumps({"run_id": run_id, "resumed_from": str(ckpt) if ckpt else None,
                                               "data": record}, indent=2))
    if hydra_record is not None:
        hydra_record.write(path)
    return RunFolder(path, run_id, ckpt, lock)
