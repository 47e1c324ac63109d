"""Metadata sync: the only collectives of the loss path, once per optimizer step.

Runs after the step's micro-batches are built and split across CP, before the first forward.
Two small integer all-reduces, whatever the number of samples or micro-batches:
  1. within the CP group: per-sample local valid-token counts of every micro-batch, one flat
     vector -> T_b (a sample split across CP ranks is counted in full, once);
  2. across DP only: [B_local, N_local·cp-summed] -> B_global, N_global (CP ranks of a group
     hold the same samples, so summing B over CP would count them cp times).

Losses that need a statistic of a whole sequence (DPO's per-sequence log-prob sum) add one
more small collective, the statistics sync (`sync_sequence_sums`): detached per-sequence sums
over the world group, before the backward. Models with mixture-of-experts layers add one
integer all-reduce per micro-batch within the CP group after the forward (`sync_expert_counts`:
the routed slots of whole samples, for the per-sample balance loss). Loss functions themselves
never communicate.
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


def sync_sequence_sums(partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The statistics sync: per-sequence (or per-token) values from the parts each rank holds.

    A call's sequences are spread over the DP ranks and split over the CP ranks, so a statistic
    of a whole sequence (DPO's Σ_t w·log p, a gathered log-prob) is a sum of parts held by
    different ranks. partial: [S] float64, entry s = this rank's part of value s (0 where it
    holds none of it). group: the world group (DP × CP; None for one process). Returns the same
    tensor, summed in place over the group: the full values, identical on every rank.

    Detached on purpose: a statistic enters the loss as a constant coefficient (see
    dit_train/posttrain/losses.py), so no gradient ever crosses ranks through it. One
    all-reduce, whatever the number of sequences.
    """
    if partial.requires_grad:
        raise ValueError("sync_sequence_sums takes detached values (statistics enter losses as constants)")
    if group is not None:
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial


def sync_expert_counts(local: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Expert counts of whole samples from the parts the CP ranks hold.

    local: [M, S, E] int64, this rank's routed slots per (MoE layer, sample of the micro-batch,
    expert) (`loss.moe.local_expert_counts`). cp_group: this rank's CP group (None if cp = 1).
    Summed in place within the CP group — like T_b, a sample split across CP ranks is counted
    in full, and the CP ranks of a group hold the same samples. One all-reduce per micro-batch
    of a model with MoE layers; detached (the balance loss's gradient needs the counts only as
    constants, see dit_train/loss/moe.py).
    """
    if cp_group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=cp_group)
    return local
