"""Checkpoint folders: save, find, load (sharded, torch.distributed.checkpoint).

Layout of a run dir:

    checkpoints/step_00000010/   a complete checkpoint: DCP shards + .metadata (sharded parts),
                                 trainer.json (step, world size, run id, JSON parts), config.yaml,
                                 rng_rank<r>.safetensors (each rank's torch RNG), and last
                                 integrity.json (size and CRC-32 of every other file)
    checkpoints/.step_00000020.tmp   a save in progress (or one a crash interrupted: ignored)

A save writes everything into the temporary directory, all ranks meet at a barrier, then rank
0 renames it into place: a crash mid-save never touches the latest good checkpoint, and only
renamed directories count. Tensors are stored by parameter name with their global shapes,
so a checkpoint loads into any layout (another FSDP degree, CP folded in or not, 1 process).
`train.resume=auto` takes the newest intact checkpoint (integrity.py: its integrity record,
else its DCP index) and says which ones it skipped and why. A save that fails on any rank (disk
full, permissions; torch's writer raises a BaseException, CheckpointException) stops the run
with one message naming the folder and the cause, removes the partial `.tmp`, and leaves the
previous checkpoints untouched.

Loading never runs code from the folder's files (safe_load.py): DCP's `.metadata` (a pickle)
is read by an unpickler that builds only checkpoint metadata, non-tensor values by
`torch.load(weights_only=True)`, the RNG state is safetensors and small state JSON. A forged
folder (a pickle payload, its integrity record rewritten to match) is refused with one line
naming the file, on every path that opens a checkpoint: resume, tools.export_weights,
tools.sample and TrainingSession.load.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from dit_train.checkpoint import safe_load
from dit_train.checkpoint.integrity import INTEGRITY, integrity_record, verify_checkpoint
from dit_train.checkpoint.parts import Part
from dit_train.checkpoint.safe_load import METADATA, describe, reraise_interrupt
from dit_train.config.errors import CheckpointError

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
FORMAT = 2  # trainer.json layout; 1 (no "format" key): {"step", "world_size", "scheduler", "trainer"}
__all__ = ["CheckpointError", "INTEGRITY", "checkpoint_root", "find_checkpoint", "integrity_record", "list_checkpoints",
           "load_checkpoint", "read_checkpoint_info", "resolve_checkpoint", "save_checkpoint", "verify_checkpoint"]


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Checkpoint folders under `root` (renamed into place, so holding trainer.json or a DCP
    index; whether they are intact is verify_checkpoint's call), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and ((p / "trainer.json").exists() or (p / METADATA).exists()):
            out.append((int(m.group(1)), p))
    return sorted(out)


def _holds_checkpoint(p: Path) -> bool:
    return (p / "trainer.json").exists() or (p / METADATA).exists()


def _newest_intact(found: list[tuple[int, Path]], what: str) -> Path | None:
    for _, p in reversed(found):
        why = verify_checkpoint(p)
        if not why:
            return p
        log.warning("skipping damaged checkpoint %s (%s); trying the previous one", p, why)
    if found:
        raise FileNotFoundError(f"{what}: every checkpoint there is damaged (see the warnings above)")
    return None


def _intact(p: Path, what: str, fix: str) -> Path:
    why = verify_checkpoint(p)
    if why:
        raise FileNotFoundError(f"{what}: the checkpoint is damaged ({why}); {fix}")
    return p


def find_checkpoint(path: str | Path, what: str = "") -> Path | None:
    """`path` itself if it is a checkpoint folder (it must be intact), else the newest intact
    checkpoint in `path` or `path`/checkpoints; None if neither holds one. Messages start with
    `what` (default: the path). Raises FileNotFoundError for damaged ones, UnsafeCheckpoint for
    forged ones."""
    p = Path(path).expanduser()
    what = what or str(p)
    if _holds_checkpoint(p):
        return _intact(p, what, "use an earlier checkpoint")
    for root in (p, checkpoint_root(p)):
        if found := list_checkpoints(root):
            return _newest_intact(found, what)
    return None


def resolve_checkpoint(spec: str, run_dir: str | Path) -> Path | None:
    """train.resume -> a checkpoint dir. '' -> None; 'auto' -> the newest intact one in this run
    dir (None if there is none); a path -> that checkpoint (which must be intact), or the newest
    intact one in that run dir."""
    if not spec:
        return None
    if spec == "auto":
        return _newest_intact(list_checkpoints(checkpoint_root(run_dir)), f"train.resume=auto in {run_dir}")
    p = Path(spec).expanduser()
    if _holds_checkpoint(p):
        return _intact(p, f"train.resume={spec}", "resume from an earlier one (or train.resume=auto)")
    found = find_checkpoint(p, f"train.resume={spec}")
    if found is None:
        raise FileNotFoundError(f"train.resume={spec}: no complete checkpoint there "
                                f"(expected a checkpoints/step_XXXXXXXX dir or a run dir holding one)")
    return found


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _quiet():
    """DCP warns "assuming ... a single process" when world = 1: yes, that is intended."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*single process.*")
    return ctx


# -- per-rank RNG: safetensors, never a pickle -------------------------------------------------


def _save_rng(path: Path) -> None:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(state, str(path))


def _load_rng(ckpt: Path) -> None:
    """This rank's torch RNG, if the checkpoint was written by the same number of ranks (nothing
    in the loss uses it: noise is a function of (seed, sample id, step); user code may)."""
    new, old = ckpt / f"rng_rank{_rank()}.safetensors", ckpt / f"rng_rank{_rank()}.pt"
    if new.exists():
        r = load_file(str(new))
        cuda = [r[k] for k in sorted((k for k in r if k.startswith("cuda")), key=lambda k: int(k[4:]))]
    elif old.exists():  # format 1: a dict of tensors; weights_only refuses anything else
        try:
            r = torch.load(old, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{old} holds more than tensors and was not loaded (a pickle can run code): "
                                  f"{safe_load.refusal_reason(err)}; use checkpoints from trusted sources only") from None
        cuda = r.get("cuda", [])
    else:
        return
    torch.set_rng_state(r["torch"])
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# -- save / load --------------------------------------------------------------------------------


def _all_ok(error: str) -> str:
    """Every rank's error of a save phase ('' = none), agreed on by all ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return error
    errors: list[str] = [""] * _world()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")


def _owner(ckpt: Path) -> str | None:
    """The run id a checkpoint was saved by ('' for checkpoints older than run ids; None if its
    trainer.json cannot be read: such a folder is not pruned)."""
    try:
        return read_checkpoint_info(ckpt).get("run_id", "")
    except (OSError, ValueError, KeyError):
        return None


def save_checkpoint(run_dir: str | Path, step: int, parts: dict[str, Part], config_yaml: str, keep_last: int,
                    run_id: str = "") -> Path:
    """Save after optimizer step `step` (every rank calls this). Returns the final directory.
    Pruning keeps the newest `keep_last` of this run's checkpoints (`run_id`) and never touches
    another run's. A failure on any rank raises CheckpointError on every rank (one line: the
    folder and the cause) once rank 0 removed the partial `.tmp`; Ctrl-C stays an interrupt."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    error = ""
    try:
        if _rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
    except OSError as err:
        error = describe(err)
    if not (error := _all_ok(error)):
        sharded = {name: p.state_dict() for name, p in parts.items() if p.sharded}
        # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start); only a save needs it
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException  # (the same)

        q = _quiet()
        try:  # DCP gathers every rank's write result: it fails on all ranks alike
            dcp.save(sharded, checkpoint_id=str(tmp))
            _save_rng(tmp / f"rng_rank{_rank()}.safetensors")
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any write failure becomes one clear
            # message; DCP reports its writer's failures (every rank's) as CheckpointException, a BaseException
            if isinstance(err, CheckpointException):
                reraise_interrupt(err)
            error = describe(err)
        finally:
            q.__exit__(None, None, None)
        error = _all_ok(error)
    if not error and _rank() == 0:
        try:
            small = {name: p.state_dict() for name, p in parts.items() if not p.sharded}
            meta = {"format": FORMAT, "step": step, "world_size": _world(), "run_id": run_id,
                    "sharded": sorted(sharded), "parts": small}
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / "trainer.json").write_text(json.dumps(meta, indent=2, default=_jsonable))
            (tmp / INTEGRITY).write_text(json.dumps(integrity_record(tmp)))
            if final.exists():  # re-saving a step (after a restart): replace the old copy
                shutil.rmtree(final)
            os.replace(tmp, final)
            mine = [(s, p) for s, p in list_checkpoints(root) if _owner(p) in ("", run_id)]
            for _, old in mine[:-keep_last] if keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as err:
            error = describe(err)
    if error := _all_ok(error):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = [p for _, p in list_checkpoints(root)]
        raise CheckpointError(f"could not write the checkpoint of step {step} to {root}: {error}; free space or fix "
                              f"permissions there" + (f" (the newest complete checkpoint is {prev[-1]})" if prev else ""))
    return final


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"cannot store {type(x).__name__} in trainer.json")


def read_checkpoint_info(path: str | Path) -> dict[str, Any]:
    """trainer.json in the current format: {"step", "world_size", "sharded": [...], "parts": {...}}."""
    meta = json.loads((Path(path) / "trainer.json").read_text())
    if "format" not in meta:  # format 1
        meta = {"format": 1, "step": meta["step"], "world_size": meta.get("world_size"), "sharded": ["model", "optim"],
                "parts": {"scheduler": meta["scheduler"], "trainer": meta.get("trainer", {})}}
    return meta


def load_checkpoint(path: str | Path, parts: dict[str, Part]) -> int:
    """Load a checkpoint into already built (parallelized) parts, any layout. Returns its step.

    A part the checkpoint does not hold is an error unless the part is optional (it then keeps
    its current state, and a warning says so).
    """
    path = Path(path)
    info = read_checkpoint_info(path)
    stored = set(info["sharded"]) | set(info["parts"])
    missing = [n for n in parts if n not in stored]
    required = [n for n in missing if not parts[n].optional]
    if required:
        raise ValueError(f"checkpoint {path} has no {', '.join(required)} state (it holds {', '.join(sorted(stored))}); "
                         f"resume with the settings it was written with")
    for n in missing:
        log.warning("checkpoint %s has no %s state: starting it fresh", path, n)
    sharded = {n: p.state_dict() for n, p in parts.items() if p.sharded and n in stored}
    keys = safe_load.read_metadata(path).state_dict_metadata
    for n in sharded:  # a part may hold less than its template (optimizer state of parameters without gradients yet)
        if hasattr(parts[n], "stored_only"):
            sharded[n] = parts[n].stored_only(sharded[n], {k[len(n) + 1:] for k in keys if k.startswith(f"{n}.")})
    q = _quiet()
    try:
        safe_load.load(sharded, path)
    finally:
        q.__exit__(None, None, None)
    for n, state in sharded.items():
        parts[n].load_state_dict(state)
    for n, p in parts.items():
        if not p.sharded and n in info["parts"]:
            try:
                p.load_state_dict(info["parts"][n])
            except (KeyError, TypeError, ValueError, AttributeError) as err:  # a hand-edited or damaged entry
                raise CheckpointError(f"{path}/trainer.json: its {n} state does not load ({type(err).__name__}: "
                                      f"{err}); the checkpoint is damaged: resume from an earlier one") from None
    for n in missing:  # after the others: a fresh part may start from the loaded weights (EMA)
        if hasattr(parts[n], "missing_from_checkpoint"):
            parts[n].missing_from_checkpoint()
    if info.get("world_size") == _world():
        _load_rng(path)
    return int(info["step"])
