"""Checkpoints (sharded, torch.distributed.checkpoint) and full-weight export.

Layout of a run dir:

    checkpoints/step_00000010/   a complete checkpoint (DCP shards + .metadata, trainer.json,
                                 config.yaml, rng_rank<r>.pt)
    checkpoints/.step_00000020.tmp   a save in progress (or one a crash interrupted: ignored)

A save writes everything into the temporary directory, all ranks meet at a barrier, then rank
0 renames it into place: a crash mid-save never touches the latest good checkpoint, and only
renamed directories count. DCP stores tensors by parameter name with their global shapes, so
a checkpoint loads into any layout (another FSDP degree, CP folded in or not, 1 process).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU state dict; a collective under FSDP (every rank must call it).

    Keys are those of the plain model: wrapper prefixes (DDP `module.`, activation
    checkpointing, torch.compile) are removed by torch.distributed.checkpoint.
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().to(torch.float32, copy=True).contiguous() for k, v in sd.items()}


def save_safetensors(sd: dict[str, torch.Tensor], path: str | Path) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_file(sd, str(tmp))
    tmp.replace(path)  # atomic: a reader never sees half a file


def export_weights(model: nn.Module, path: str | Path, is_main: bool) -> None:
    sd = full_state_dict(model)
    if is_main:
        save_safetensors(sd, path)


# --------------------------------------------------------------------------- checkpoints


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "trainer.json").exists() and (p / ".metadata").exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def resolve_checkpoint(spec: str, run_dir: str | Path) -> Path | None:
    """train.resume -> a checkpoint dir. '' -> None; 'auto' -> the newest complete one in this
    run dir (None if there is none); a path -> that checkpoint, or the newest in that run dir."""
    if not spec:
        return None
    if spec == "auto":
        found = list_checkpoints(checkpoint_root(run_dir))
        return found[-1][1] if found else None
    p = Path(spec).expanduser()
    if (p / "trainer.json").exists():
        return p
    for root in (p, checkpoint_root(p)):
        found = list_checkpoints(root)
        if found:
            return found[-1][1]
    raise FileNotFoundError(f"train.resume={spec}: no complete checkpoint there "
                            f"(expected a checkpoints/step_XXXXXXXX dir or a run dir holding one)")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, extra: dict[str, Any], config_yaml: str, keep_last: int) -> Path:
    """Save after optimizer step `step` (every rank calls this). Returns the final directory.

    extra: JSON-serialisable trainer state (skipped counters, loss scale, ...).
    Nothing random that touches the loss needs saving (it is a function of seed, sample id and
    step); the global torch RNG of each rank is kept anyway for user code that draws from it.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, when world = 1
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        meta = {"step": step, "world_size": _world(), "scheduler": scheduler.state_dict(), "trainer": extra}
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=2, default=_jsonable))
        if final.exists():  # re-saving a step (after a restart): replace the old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"cannot store {type(x).__name__} in trainer.json")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any | None) -> dict[str, Any]:
    """Load a checkpoint into an already parallelized model/optimizer (any layout).

    Returns trainer.json's content ({"step", "trainer", ...}).
    """
    path = Path(path)
    meta = json.loads((path / "trainer.json").read_text())
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.exists() and meta.get("world_size") == _world():
        r = torch.load(rng, weights_only=False)
        torch.set_rng_state(r["torch"])
        if "cuda" in r and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(r["cuda"])
    return meta


def read_config(path: str | Path) -> Any:
    """The typed Config stored as config.yaml in a checkpoint or run dir."""
    from omegaconf import OmegaConf

    from dit_train.config import Config

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(Path(path) / "config.yaml")))


def checkpoint_weights(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(Config, full fp32 weights) of a checkpoint, in one process (no GPU, no process group)."""
    from dit_train.models import build_model

    path = Path(path)
    cfg = read_config(path)
    model = build_model(cfg.model)
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load({"model": sd}, checkpoint_id=str(path))
    return cfg, {k: v.float().contiguous() for k, v in sd.items()}


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Full weights of a checkpoint as safetensors, in one process (no GPU, no process group)."""
    _, sd = checkpoint_weights(path)
    save_safetensors(sd, out)
    return Path(out)


def export_diffusers(cfg: Any, state_dict: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write full weights of a model.name=wan run as a diffusers WanTransformer3DModel folder
    (`save_pretrained`: config.json + safetensors), loadable with `from_pretrained`."""
    if cfg.model.name != "wan":
        raise ValueError(f"--diffusers exports model.name=wan runs; this one is model.name={cfg.model.name}")
    from dit_train.models.wan import to_diffusers

    to_diffusers(state_dict, cfg.model).save_pretrained(str(out_dir))
    return Path(out_dir)
