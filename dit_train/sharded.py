"""Is this tensor a DTensor, this module an FSDP2 module? Asked without importing
torch.distributed.tensor / torch.distributed.fsdp: those pull sympy and torch.fx's symbolic
shapes (~1.5 CPU-s at every start of `python -m dit_train` or a tool), and a one-process run,
`--help` or a refused config never makes a DTensor. Whatever makes one (FSDP2, expert
parallelism, a distributed checkpoint) has imported the module first, so a module that is not
loaded yet means no object can be of its type."""
from __future__ import annotations

import sys
from typing import Any

import torch


def loaded_type(module: str, name: str) -> type | None:
    """`module.name` if `module` is imported already, else None (nothing can be of that type yet)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def is_dtensor(t: Any) -> bool:
    """isinstance(t, torch.distributed.tensor.DTensor), without importing it."""
    cls = loaded_type("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(t, cls)


def is_fsdp_module(m: Any) -> bool:
    """isinstance(m, torch.distributed.fsdp.FSDPModule), without importing it."""
    cls = loaded_type("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and isinstance(m, cls)


def local_part(t: Any) -> Any:
    """A DTensor's local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def fp32_copy(t: Any) -> Any:
    """A detached float32 copy of `t`, a DTensor placed like it when it is one. Made from the local
    part: an op on the DTensor itself (detach, to) goes through DTensor's dispatch, whose first
    call per (op, mesh, shape) propagates the sharding on fake tensors (~10 ms)."""
    if not is_dtensor(t):
        return t.detach().to(torch.float32, copy=True)
    return from_local_like(t.to_local().detach().to(torch.float32, copy=True), t)


def from_local_like(local: torch.Tensor, p: Any) -> Any:
    """This rank's part `local` of a tensor placed like DTensor `p` (same mesh, placements,
    global shape and stride), as a DTensor: no check, no traffic."""
    from torch.distributed.tensor import DTensor  # loaded already (p is a DTensor)

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def distribute_like(full: Any, p: Any) -> Any:
    """`full` (the same whole tensor on every rank) as a DTensor placed like DTensor `p`: each
    rank keeps its own slice, no traffic (src_data_rank=None)."""
    # loaded already (p is a DTensor); imported here so that a one-process run never loads it
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
