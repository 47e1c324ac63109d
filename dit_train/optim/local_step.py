"""An elementwise optimizer's step on each rank's local shards of its DTensor parameters.

SGD's and AdamW's updates are elementwise per parameter, so a DTensor's update is its local
part's update: DTensor's dispatch of each op (`add_`, `lerp_`, `addcdiv_`...) adds nothing but
cost — ~0.1 ms an op, and at the first step of every layout a sharding propagation per op and
parameter shape (~4 ms each: ~8 ops x 16 shapes for AdamW on a one-block tiny DiT, ~0.5 CPU-s of
a rank's first step). `step` hands the optimizer the local parts for the duration of one step
and puts the DTensors back after it: between steps the optimizer holds the DTensor parameters
and DTensor state a checkpoint saves and loads (torch.distributed.checkpoint), as before. No
collective.
"""
from __future__ import annotations

from typing import Any

import torch

from dit_train.sharded import from_local_like, is_dtensor

# torch's per-tensor (foreach=False) updates of these touch each element on its own
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def step(optimizer: torch.optim.Optimizer) -> None:
    """optimizer.step(), on the local parts of DTensor parameters, gradients and state when the
    optimizer is elementwise (ELEMENTWISE, foreach off); otherwise (Muon, 8-bit AdamW, plain
    tensors) as it is."""
    groups = optimizer.param_groups
    if type(optimizer) not in ELEMENTWISE or any(g.get("foreach") or g.get("fused") for g in groups) \
            or not any(is_dtensor(p) for g in groups for p in g["params"]):
        optimizer.step()
        return
    swapped = _to_local(optimizer)
    try:
        optimizer.step()
    finally:
        _restore(optimizer, swapped)


# the params list and index, the DTensor parameter, its local part, its state before the step and
# that state's local parts
Swap = tuple[list, int, Any, torch.Tensor, dict[str, Any], dict[str, Any]]


@torch.no_grad()
def _to_local(optimizer: torch.optim.Optimizer) -> list[Swap]:
    swapped = []
    state = optimizer.state
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if not is_dtensor(p):
                continue
            local = p.to_local()  # a view of the shard (under no_grad: no autograd node)
            local.grad = None if p.grad is None else p.grad.to_local()
            own = state.pop(p, {})
            before = {k: v.to_local() if is_dtensor(v) else v for k, v in own.items()}
            state[local] = dict(before)
            params[i] = local
            swapped.append((params, i, p, local, own, before))
    return swapped


@torch.no_grad()
def _restore(optimizer: torch.optim.Optimizer, swapped: list[Swap]) -> None:
    """The DTensors back in the groups and state. State the step kept is the DTensor it was
    (updated in place through its local part); state it made (the first step's moments, SGD's
    momentum buffer) becomes a DTensor placed like its parameter, as it would have been made on
    the DTensor; 'step' counters stay plain tensors, as torch makes them."""
    state = optimizer.state
    for params, i, p, local, own, before in swapped:
        params[i] = p
        local.grad = None
        now = state.pop(local, {})
        out = {}
        for k, v in now.items():
            if k in own and v is before[k]:
                out[k] = own[k]
            elif k != "step" and isinstance(v, torch.Tensor) and v.shape == local.shape:
                out[k] = from_local_like(v, p)
            else:
                out[k] = v
        if out:
            state[p] = out
