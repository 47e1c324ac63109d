"""Metadata sync: the only collectives of the loss path, once per optimizer step.

Runs after the step's micro-batches are built and split across CP, before the first forward.
Two small integer all-reduces, whatever the number of samples or micro-batches:
  1. within the CP group: per-sample local sums of token weights of every micro-batch, one
     flat vector -> T_b = Σ_t w_t (a sample split across CP ranks is counted in full, once; a
     rank holding only context tokens of a sample adds 0 and still takes part);
  2. across DP only: [B_local, N_local·cp-summed] -> B_global (samples with T_b > 0), N_global
     = Σ w (CP ranks of a group hold the same samples, so summing B over CP would count them
     cp times).
With several streams (audio + video, `streams` > 1) the same two all-reduces carry them: the
first vector holds T_{b,s} per (sample, stream) instead of T_b (the CP group again: a rank may
hold no audio token of a sample and adds 0), the second appends B_s, the samples with
T_{b,s} > 0, per stream (the DP group: a clip without audio is in B_video, not in B_audio).
Weights travel as int64 multiples of 1/WEIGHT_ONE (dit_train/batch.py): integer sums are
exact in any order, so T_b, B and N are the same on every layout also for fractional weights;
they become float64 token units (a whole token = 1) only after the sums.

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

from dit_train.batch import WEIGHT_ONE, PackedBatch
from dit_train.loss.reductions import StepCounts


def to_tokens(units: int) -> int | float:
    """A weight sum in units of 1/WEIGHT_ONE -> tokens: an int when whole (every weight 0 or 1)."""
    return units // WEIGHT_ONE if units % WEIGHT_ONE == 0 else units / WEIGHT_ONE


def sync_counts(batches: list[PackedBatch], cp_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                  world: int = 1, device: torch.device | str = "cpu", streams: int = 1) -> StepCounts:
    """Global counts for the step from this rank's (CP-local) micro-batches.

    cp_group: the CP group of this rank (all-reduce SUM of per-sample counts), None if cp = 1.
    dp_group: the DP group of this rank (all-reduce SUM of sample/token totals), None if dp = 1.
    world: dp·cp, recorded for naive_mean.
    streams: the streams the packs' tokens belong to (`PackedBatch.stream`; 1 = none given).
        With more, the CP all-reduce carries [S_k·streams] per micro-batch and the DP one
        streams more entries (B_s); still two all-reduces per step.
    """
    if streams == 1:
        local = [b.local_weights().to(device=device, dtype=torch.int64) for b in batches]
    else:
        local = [b.local_stream_weights(streams).to(device=device).reshape(-1) for b in batches]
    sizes = [t.numel() for t in local]
    # one trailing zero keeps the vector non-empty when this rank's micro-batches hold no sample
    flat = torch.cat(local + [torch.zeros(1, dtype=torch.int64, device=device)])
    if cp_group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=cp_group)
    flat = flat[:-1]
    per_stream = flat.view(-1, streams)  # [Σ_k S_k, streams] T_{b,s}
    whole = per_stream.sum(1)  # [Σ_k S_k] T_b = Σ_s T_{b,s}
    totals = torch.cat([torch.stack([(whole > 0).sum(), whole.sum()]),
                        (per_stream > 0).sum(0) if streams > 1 else whole.new_zeros(0)]).to(torch.int64)
    if dp_group is not None:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dp_group)
    b_global, n_global, *b_streams = totals.tolist()
    counts = [n // streams for n in sizes]
    return StepCounts(
        sample_tokens=[t.cpu().double() / WEIGHT_ONE for t in torch.split(whole, counts)],
        num_samples=int(b_global),
        num_tokens=to_tokens(int(n_global)),
        local_tokens=[to_tokens(int(b.weight_units().sum())) for b in batches],
        world=world,
        stream_tokens=[t.cpu().double() / WEIGHT_ONE for t in torch.split(per_stream, counts)] if streams > 1 else None,
        stream_samples=[int(b) for b in b_streams] if streams > 1 else None,
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
