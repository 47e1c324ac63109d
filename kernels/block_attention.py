"""Attention over per-sample blocks (`blocks.SampleBlocks`) that also returns the log-sum-exp.

    block_attention_with_lse(q [Lq, H, D], k [Lk, H, D], v [Lk, H, D], plan, backend)
        -> out [Lq, H, D] (dtype of q), lse [H, Lq] (fp32; fp64 for fp64 inputs)

A ring step's partial result: each query attends to the keys of its own sample in this key set
(causal by in-sample position when the plan is causal), and the LSE lets partials over disjoint
key sets merge exactly (`lse.merge_partials`). A query that sees no key here gets out 0
and lse = MASKED (finite, so its merge weight is exp(MASKED − LSE) = 0 and no NaN appears).
Nothing of size Lq·Lk is built: the queries and keys of each block are gathered by index, and
a kernel's memory is at most Σ over blocks of nq·nk (the math kernel), O(Lq + Lk) for the fused ones.

Kernels (`backend` as resolved by `attention.resolve_backend`):
  sdpa / auto, CPU   torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`,
                     which returns the LSE), one batched call per group of equal blocks.
  sdpa etc., CUDA    torch's memory-efficient CUDA kernel (`_scaled_dot_product_efficient_attention`
                     with compute_log_sumexp), likewise; flash-attn's public varlen function
                     drops the LSE's gradient, so `flash` and `xformers` take this path too.
  flex               flex_attention over all blocks at once with a document block mask and
                     the LSE (its backward takes the LSE's gradient; no CPU backward in torch 2.13).
  math               scores per block in fp32 (fp64 for fp64): the reference, used for
                     `masked` blocks, fp64 on CUDA, and when `backend="math"`.

torch's fused kernels treat their LSE output as non-differentiable, but the merge needs its
gradient: with dlse the scores' gradient is dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O) + dlse). The
kernels' backward computes rowsum(dO ∘ O) itself from the `out` it is given, so `_FusedLse`
calls it with one extra zero column on q, k, v, a column of ones on out and −dlse on dO: the
extra column adds −dlse to that row sum and nothing else (q·k, P and dV are unchanged).
"""
from __future__ import annotations

import torch

from dit_train.kernels.blocks import BlockGroup, SampleBlocks
from dit_train.kernels.eager import eager
from dit_train.kernels.flex import flex_kernel
from dit_train.kernels.lse import MASKED

aten = torch.ops.aten


def _cpu_forward(q, k, v, is_causal: bool, scale: float):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, extras, is_causal: bool, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal,
                                                                    scale=scale)


def _cuda_forward(q, k, v, is_causal: bool, scale: float):
    # the LSE comes back padded to a multiple of 32 queries; the backward wants it so
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                          scale=scale)
    return out, lse, (seed, offset)


def _cuda_backward(dout, q, k, v, out, lse, extras, is_causal: bool, scale: float):
    seed, offset = extras
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], is_causal, scale=scale)
    return dq, dk, dv


# extra columns of the LSE trick: 1 on the CPU; 8 on CUDA, where the kernel is fastest (and,
# for 16-bit inputs, only runs) with head dims that are multiples of 8
_FUSED = {"cpu": (_cpu_forward, _cpu_backward, 1), "cuda": (_cuda_forward, _cuda_backward, 8)}


class _FusedLse(torch.autograd.Function):
    """A fused kernel's (out, lse) with a backward that takes both gradients (module docstring).

    q: [B, H, nq, D], k/v: [B, H, nk, D] -> out [B, H, nq, D], lse [B, H, nq] (fp32, fp64 for fp64)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, scale: float, device: str):
        fwd, _, _ = _FUSED[device]
        out, lse, extras = fwd(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, *extras)
        ctx.args = (is_causal, scale, device)
        return out, lse[..., :q.shape[2]]

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *extras = ctx.saved_tensors
        is_causal, scale, device = ctx.args
        _, bwd, pad = _FUSED[device]
        nq = q.shape[2]

        def widen(t: torch.Tensor, first: float) -> torch.Tensor:
            extra = t.new_zeros(*t.shape[:-1], pad)
            extra[..., 0] = first
            return torch.cat([t, extra], dim=-1)

        if dlse is None:
            dlse = torch.zeros(lse.shape[:-1] + (nq,), dtype=lse.dtype, device=lse.device)
        dout = torch.cat([dout, torch.zeros_like(dout[..., :1]).expand(*dout.shape[:-1], pad)], dim=-1)
        dout[..., -pad] = -dlse.to(dout.dtype)
        dq, dk, dv = bwd(dout, widen(q, 0.0), widen(k, 0.0), widen(v, 0.0), widen(out, 1.0), lse, extras,
                         is_causal, scale)
        return dq[..., :-pad], dk[..., :-pad], dv[..., :-pad], None, None, None


def _fused_ok(q: torch.Tensor) -> bool:
    if q.device.type == "cpu":
        return True
    return q.device.type == "cuda" and q.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _math_group(qb, kb, vb, g: BlockGroup, pos_q, pos_k, scale: float):
    """qb [count, nq, H, D], kb/vb [count, nk, H, D] -> out [count, nq, H, D], lse [count, H, nq]."""
    acc = torch.promote_types(qb.dtype, torch.float32)
    s = torch.einsum("bqhd,bkhd->bhqk", qb.to(acc), kb.to(acc)) * scale
    if g.kind == "causal":
        keep = torch.ones(g.nq, g.nk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, MASKED)
    elif g.kind == "masked":
        keep = pos_k.view(g.count, 1, g.nk) <= pos_q.view(g.count, g.nq, 1)  # [count, nq, nk]
        s = s.masked_fill(~keep[:, None], MASKED)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vb.to(acc))
    return out.to(qb.dtype), lse


def _group_attention(q, k, v, plan: SampleBlocks, backend: str, scale: float):
    """One kernel call per group of equal blocks -> out [Nq, H, D], lse [H, Nq] over the plan's rows."""
    outs, lses = [], []
    fused = backend != "math" and _fused_ok(q)
    for g in plan.groups:
        rq = slice(g.start_q, g.start_q + g.count * g.nq)
        rk = slice(g.start_k, g.start_k + g.count * g.nk)
        qb = q[rq].view(g.count, g.nq, *q.shape[1:])
        kb, vb = (t[rk].view(g.count, g.nk, *t.shape[1:]) for t in (k, v))
        if fused and g.kind != "masked":
            # [count, n, H, D] -> [count, H, n, D]: the kernels' layout (a view)
            o, lse = _FusedLse.apply(*(t.transpose(1, 2) for t in (qb, kb, vb)), g.kind == "causal", scale,
                                     q.device.type)
            o = o.transpose(1, 2)
        else:
            o, lse = _math_group(qb, kb, vb, g, plan.pos_q[rq], plan.pos_k[rk], scale)
        outs.append(o.reshape(g.count * g.nq, *q.shape[1:]))
        lses.append(lse.transpose(0, 1).reshape(q.shape[1], g.count * g.nq))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _flex_block_mask(plan: SampleBlocks, device: torch.device):
    """The plan's document mask for flex (built once per plan and device, reused by every layer)."""
    from torch.nn.attention.flex_attention import create_block_mask  # deferred: imports torch._dynamo (~1.8 s)

    key = ("flex_block_mask", str(device))
    if key not in plan.cache:
        bq, bk, pq, pk = (t.to(device) for t in (plan.seg_q, plan.seg_k, plan.pos_q, plan.pos_k))
        causal = plan.causal

        def mask_mod(b, h, qi, ki):
            m = bq[qi] == bk[ki]
            if causal:
                m = m & (pk[ki] <= pq[qi])
            return m

        plan.cache[key] = create_block_mask(mask_mod, None, None, plan.covered, int(plan.k_index.numel()),
                                            device=device)
    return plan.cache[key]


def _flex_attention(q, k, v, plan: SampleBlocks, scale: float):
    from torch.nn.attention.flex_attention import AuxRequest  # deferred: imports torch._dynamo (~1.8 s)

    bm = _flex_block_mask(plan, q.device)
    o, aux = flex_kernel(q.is_cuda)(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=bm,
                                     scale=scale, return_aux=AuxRequest(lse=True))
    acc = torch.promote_types(q.dtype, torch.float32)
    # every kept query sees a key, so flex's LSE is finite; clamp only guards the MASKED convention
    return o.squeeze(0).transpose(0, 1), aux.lse.squeeze(0).to(acc).clamp_min(MASKED)


@eager  # plan sizes are Python ints per pack (like attention._sdpa_loop): a graph break under compile
def block_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SampleBlocks,
                             backend: str = "sdpa", scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample block attention and its LSE (module docstring).

    q: [Lq, H, D]; k, v: [Lk, H, D]; plan: `blocks.sample_blocks` of these query and key rows,
    on q's device. Returns out [Lq, H, D] in q's dtype and lse [H, Lq] (fp32, fp64 for fp64).
    Differentiable in q, k and v (including through lse). backend: a resolved backend name
    (flex -> flex_attention; math -> the fp32 reference; any other -> torch's fused kernel).
    """
    H, D = q.shape[1:]
    scale = D ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    if plan.empty:
        return q.new_zeros(q.shape), torch.full((H, q.shape[0]), MASKED, dtype=acc, device=q.device)
    qg, kg, vg = q[plan.q_index], k[plan.k_index], v[plan.k_index]
    if backend == "flex":
        out, lse = _flex_attention(qg, kg, vg, plan, scale)
    else:
        out, lse = _group_attention(qg, kg, vg, plan, backend, scale)
    # rows that see no key read the appended zero row / MASKED column
    out = torch.cat([out, out.new_zeros(1, H, D)])[plan.rows]
    lse = torch.cat([lse.to(acc), lse.new_full((H, 1), MASKED, dtype=acc)], dim=1)[:, plan.rows]
    return out, lse
