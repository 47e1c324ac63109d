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


def _runs(seg: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, id) of each maximal run of equal ids (one host sync)."""
    L = seg.numel()
    if L == 0:
        return []
    change = torch.ones(L, dtype=torch.bool, device=seg.device)
    change[1:] = seg[1:] != seg[:-1]
    starts = torch.nonzero(change).flatten()
    bounds = torch.cat([starts, starts.new_tensor([L])]).tolist()
    ids = seg[starts].tolist()
    return [(s, e, i) for s, e, i in zip(bounds[:-1], bounds[1:], ids)]


def packed_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seg: torch.Tensor,
                           kv_len: torch.Tensor) -> torch.Tensor:
    """See the module docstring. One SDPA call per run of same-sample tokens: a pack holds a
    few runs (samples are contiguous in packs and in contiguous CP shards), so this is a short
    loop with no [L, S·Lc] mask materialised."""
    out = q.new_zeros(q.shape)
    lens = kv_len.tolist()
    used = False
    for start, end, s in _runs(q_seg):
        if s < 0 or lens[s] == 0:
            continue
        used = True
        n = lens[s]
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        ks = k[s, :n].transpose(0, 1).unsqueeze(0)
        vs = v[s, :n].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out = out.index_copy(0, torch.arange(start, end, device=q.device), o.squeeze(0).transpose(0, 1))
    if not used:
        # no query saw a caption (an empty or all-padding pack): keep q, k and v in the
        # autograd graph with an exact zero, so every projection gets a (zero) gradient. DDP
        # requires that on every rank, and a rank may well get such a micro-batch.
        out = out + 0.0 * (q.sum() + k.sum() + v.sum())
    return out
