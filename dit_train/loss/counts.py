"""Metadata sync: the only collectives of the loss path, once per optimizer step.

Runs after the step's micro-batches are built and split across CP, before the first forward.
Two small integer all-reduces, whatever the number of samples or micro-batches:
  1. within the CP group: per-sample local valid-token counts of every micro-batch, one flat
     vector -> T_b (a sample split across CP ranks is counted in full, once);
  2. across DP only: [B_local, N_local·cp-summed] -> B_global, N_global (CP ranks of a group
     hold the same samples, so summing B over CP would count them cp times).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dit_train.batch import PackedBatch
from dit_train.loss.reductions import StepCounts


def sync_counts(batches: list[PackedBatch], cp_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                  world: int = 1, device: torch.device | str = "cpu") -> StepCounts:
    """Global counts for the step from this rank's (CP-local) micro-batches.

    cp_group: the CP group of this rank (all-reduce SUM of per-sample counts), None if cp = 1.
    dp_group: the DP group of this rank (all-reduce SUM of sample/token totals), None if dp = 1.
    world: dp·cp, recorded for naive_mean.
    """
    local = [b.local_counts().to(device=device, dtype=torch.int64) for b in batches]
    sizes = [t.numel() for t in local]
    # one trailing zero keeps the vector non-empty when this rank's micro-batches hold no sample
    flat = torch.cat(local + [torch.zeros(1, dtype=torch.int64, device=device)])
    if cp_group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=cp_group)
    flat = flat[:-1]
    sample_tokens = list(torch.split(flat, sizes))
    totals = torch.stack([(flat > 0).sum(), flat.sum()]).to(torch.int64)
    if dp_group is not None:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dp_group)
    b_global, n_global = totals.tolist()
    return StepCounts(
        sample_tokens=[t.cpu() for t in sample_tokens],
        num_samples=int(b_global),
        num_tokens=int(n_global),
        local_tokens=[int(b.valid.sum()) for b in batches],
        world=world,
    )
