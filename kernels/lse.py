"""Attention with the log-sum-exp of each query row, and the exact merge of partial results.

Attention over a key set that is split into disjoint parts (ring attention's K/V blocks) is
computed part by part: each part gives (out_i, lse_i) and `merge_partials` combines them into
exactly the attention over all keys (online softmax). `attention_with_lse` is the dense math
reference of one part, with an explicit [Lq, Lk] mask (`attention_mask`): its memory grows with
Lq·Lk, so the per-sample kernels of `block_attention.py` serve the ring; this one stays the
reference (tests, `model.attn_backend=sdpa_dense`).
"""
from __future__ import annotations

import torch

# Masked logits are set to this finite value instead of -inf, so a query row that sees no key
# in one ring block yields a finite LSE (its merge weight is then exp(-1e30) = 0) and no NaN
# ever enters the backward pass. Scores are always computed in fp32.
MASKED = -1e30


def attention_mask(
    seg_q: torch.Tensor, pos_q: torch.Tensor, seg_k: torch.Tensor, pos_k: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Boolean [Lq, Lk]: True where query i may attend to key j."""
    m = seg_q[:, None] == seg_k[None, :]
    if causal:
        m &= pos_k[None, :] <= pos_q[:, None]
    return m


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns each row's log-sum-exp.

    q: [Lq, H, D], k/v: [Lk, H, D], mask: [Lq, Lk] bool.
    Returns out [Lq, H, D] (dtype of q) and lse [H, Lq] (fp32, or fp64 for fp64 inputs).
    Differentiable; computed in at least fp32.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 for bf16/fp16 inputs, fp64 stays fp64
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    s = s.masked_fill(~mask[None], MASKED)
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", p, v.to(acc))
    return out.to(q.dtype), lse


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Combine attention over disjoint key blocks: out = Σ_i exp(lse_i - lse) out_i.

    outs: list of [Lq, H, D]; lses: list of [H, Lq] (fp32/fp64). Exact, differentiable.
    """
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # [H, Lq]
    total = 0
    for o, l in zip(outs, lses):
        w = torch.exp(l - lse).transpose(0, 1)[..., None]  # [Lq, H, 1]
        total = total + w * o.to(lse.dtype)
    return total.to(outs[0].dtype)
