"""Cross-attention from a packed token sequence to per-sample context (caption) tokens.

Tokens of sample s attend only to the context of sample s. Context lives per sample (padded
to a common length), not per token, so it is identical on every CP rank and cross-attention
needs no communication at all.

    q:       [L, H, D]      queries of the packed (possibly CP-local) tokens
    k, v:    [S, Lc, H, D]  keys/values of each sample's context, valid tokens first
    q_seg:   [L] int64      sample of each query token (-1 = padding)
    kv_len:  [S] int64      valid context tokens of each sample (0 = no context)
    returns  [L, H, D]      zero rows for padding tokens and for samples without context
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dit_train.kernels.eager import eager
from dit_train.kernels.runs import group_neighbours, run_starts


@eager  # like the self-attention `sdpa` loop (kernels/attention.py): sizes from .tolist()
def packed_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seg: torch.Tensor,
                           kv_len: torch.Tensor) -> torch.Tensor:
    """See the module docstring. Tokens of a sample are contiguous (in packs and in contiguous
    CP shards), so the pack is a few runs of same-sample tokens; neighbouring runs with equal
    query and caption lengths share one batched SDPA call ([count, H, T, D] against
    [count, H, n, D]), as in the self-attention `sdpa` loop. Built from `split`/`cat`: writing
    each run into a preallocated output (index_copy) would make every run's backward touch the
    whole [L, H, D] pack — O(samples · L) per layer, which dominated the step on many-clip packs.
    No [L, S·Lc] mask is materialised."""
    lens = kv_len.tolist()
    _, starts = run_starts(q_seg)
    bounds = starts.tolist() + [q_seg.numel()]
    ids = q_seg[starts].tolist()
    # neighbouring runs with equal (query tokens T, caption tokens n) form one batch; n = 0 for
    # padding (-1) and caption-less samples, whose output is zero
    keys = [(end - start, lens[s] if s >= 0 else 0) for start, end, s in zip(bounds[:-1], bounds[1:], ids)]
    groups = group_neighbours(keys)
    outs = []
    used = False
    first = 0  # index of the group's first run (= into `ids`)
    for ((T, n), count), qs in zip(groups, q.split([T * count for (T, _), count in groups])):
        run_ids, first = ids[first:first + count], first + count
        if n == 0:
            outs.append(qs.new_zeros(qs.shape))
            continue
        used = True
        idx = torch.tensor(run_ids, device=k.device)
        qb = qs.reshape(count, T, *q.shape[1:]).transpose(1, 2)  # [count, H, T, D]
        kb = k[idx, :n].transpose(1, 2)  # [count, H, n, D]
        vb = v[idx, :n].transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, kb, vb)
        outs.append(o.transpose(1, 2).reshape(count * T, *q.shape[1:]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0] if outs else q.new_zeros(q.shape)
    if not used:
        # no query saw a caption (an empty or all-padding pack): keep q, k and v in the
        # autograd graph with an exact zero, so every projection gets a (zero) gradient. DDP
        # requires that on every rank, and a rank may well get such a micro-batch.
        out = out + 0.0 * (q.sum() + k.sum() + v.sum())
    return out
