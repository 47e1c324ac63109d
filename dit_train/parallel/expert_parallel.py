"""Expert parallelism (`parallel.ep`): the experts of every MoE layer split over ep ranks.

The world's ranks (flattened dp_replicate × dp_shard × cp_ring × cp_ulysses, in rank order) form
world/ep EP groups of ep consecutive ranks. EP rank j of a group keeps experts
[j·E/ep, (j+1)·E/ep) of every MoE layer; the ranks with the same EP rank in the other groups
(the *replica group*) keep the same experts.

Forward (`ExpertParallelDispatch`, installed as each layer's `dispatch`): the (token, expert)
rows of this rank are sorted by expert and sent to the rank owning the expert with an
all-to-all over the EP group (uneven splits: counts exchanged first), run through the local
experts, and sent back. The all-to-alls are autograd functions: backward returns the rows'
gradients home the same way.

Gradients: the owner of an expert sees the rows of every rank of its EP group, so summing its
weight gradient over the replica group gives the gradient of all tokens — a SUM, like every
gradient here (the loss already carries global weights). Expert weights are therefore left out
of FSDP2 / DDP (`expert_parameters` -> `ignored_params`) and summed by `sync_expert_grads`.

They are DTensors sharded on dim 0 over the 1-D EP mesh, so distributed checkpoints save each
rank's experts and reshard them on load (resume onto another `parallel.ep`), full state dicts
gather them, and seeded init slices the full tensor (models/init.py). ep = 1: nothing changes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from dit_train.models.moe import Experts, moe_layers, run_experts
from dit_train.parallel.mesh import ParallelContext
from dit_train.sharded import local_part


class ExpertParallelDispatch:
    """dispatch(experts, x [N, d], choice [N], E) -> [N, d] over the EP group (see module doc).

    group: this rank's EP process group (size ep); every rank of it must call, also with N = 0.
    """

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, experts: Experts, x: torch.Tensor, choice: torch.Tensor, num_experts: int) -> torch.Tensor:
        ep, local = self.ep, num_experts // self.ep
        order = torch.argsort(choice, stable=True)
        per_expert = torch.bincount(choice, minlength=num_experts)  # [E] rows this rank sends to each expert
        # [ep, local] rows each source rank sends to each of my experts (source-major)
        got = torch.empty_like(per_expert)
        dist.all_to_all_single(got, per_expert, group=self.group)
        got = got.view(ep, local)
        send = per_expert.view(ep, local).sum(dim=1).tolist()
        recv = got.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(x.index_select(0, order), recv, send, self.group)
        # received rows are grouped by source, then expert: regroup by expert for the MLPs
        key = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(got.reshape(-1))
        by_expert = torch.argsort(key, stable=True)
        # FSDP2's mixed-precision policy casts every parameter but these (they are ignored by
        # FSDP): run the experts in the dtype the rows arrive in, gradients flow back in fp32
        weights = tuple(local_part(w).to(x.dtype)
                        for w in (experts.w1, experts.b1, experts.w2, experts.b2))
        y = run_experts(weights, rows.index_select(0, by_expert), got.sum(dim=0).tolist())
        y = torch.empty_like(y).index_copy_(0, by_expert, y)  # back to source-major order
        back = all_to_all_single_autograd(y, send, recv, self.group)
        return torch.empty_like(back).index_copy_(0, order, back)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights of every MoE layer (the parameters EP owns)."""
    return [p for layer in moe_layers(model) for p in layer.experts.parameters()]


def apply_expert_parallel(model: nn.Module, ctx: ParallelContext) -> None:
    """Shard every MoE layer's experts over the EP mesh (DTensor, Shard(0)) and install the
    all-to-all dispatch. Works on meta-device models too (values are set by init later)."""
    # deferred: torch.distributed.tensor costs ~1.5 s at every start; only parallel.ep > 1 needs it here
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = ctx.views["ep"]
    dispatch = ExpertParallelDispatch(mesh.get_group(), ctx.ep)
    for layer in moe_layers(model):
        if layer.num_experts % ctx.ep:
            raise ValueError(f"model.moe.num_experts={layer.num_experts} must be divisible by parallel.ep={ctx.ep}")
        for name, p in list(layer.experts.named_parameters(recurse=False)):
            shard = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(layer.experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        layer.dispatch = dispatch


@torch.no_grad()
def sync_expert_grads(model: nn.Module, ctx: ParallelContext) -> None:
    """All-reduce SUM the local expert gradients over the replica group (ranks holding the
    same experts); one flat collective. No-op with ep = 1 or ep = world."""
    group = ctx.ep_replica_group
    if group is None:
        return
    grads = [p.grad for p in expert_parameters(model) if p.grad is not None]
    locals_ = [local_part(g) for g in grads]
    if not locals_:
        return
    flat = torch.cat([t.reshape(-1) for t in locals_])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in locals_:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
