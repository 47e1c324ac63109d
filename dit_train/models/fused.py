"""Elementwise layers with their backward written out.

Autograd through the composite form of these ops saves more and runs more full-size passes
than the maths needs: on the CPU (where torch has no fused kernel for them) the QK-RMSNorm's
backward was ~5% of a DiT step and `addcmul`'s backward multiplies by its `value` (1) in two
extra passes. Same values as the stock ops (tests/test_fused.py compares forward and
gradients); shapes in the docstrings.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.models.recompute import fused_enabled


def _opmath(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or fp64 if it is fp64 (torch's "opmath" type for reductions)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNorm(torch.autograd.Function):
    """y = x · rstd · w, rstd = 1/sqrt(mean(x²) + eps) over the last axis; computed in fp32
    (fp64 for fp64 input), returned in x's dtype.

    Saves x (usually a view of the qkv projection that attention keeps anyway) and rstd
    [..., 1]; the backward recomputes x̂ = x · rstd:
        dx = rstd · (g·w − x̂ · mean(g·w · x̂)),   dw = Σ g · x̂."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = _opmath(x)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        xhat = _opmath(x) * rstd
        gw = grad.to(xhat.dtype) * weight.to(xhat.dtype)
        dx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd
        dw = (grad.to(xhat.dtype) * xhat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dx.to(x.dtype), None if dw is None else dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, normalized_shape: tuple[int, ...],
             eps: float | None) -> torch.Tensor:
    """F.rms_norm with the hand-written backward wherever torch would run the composite form:
    on the CPU, and on CUDA when x and the weight differ in dtype (bf16 autocast over fp32
    parameters), where the composite also saves fp32 upcasts. Torch's fused CUDA kernel (same
    dtypes) and the weight-less case stay stock."""
    fused_kernel = x.device.type == "cuda" and weight is not None and x.dtype == weight.dtype
    if fused_kernel or weight is None or len(normalized_shape) != 1:
        return F.rms_norm(x, normalized_shape, weight, eps)
    return _RMSNorm.apply(x, weight, eps if eps is not None else torch.finfo(x.dtype).eps)


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameter, same state-dict key) computed by `rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, tuple(self.normalized_shape), self.eps)


class _Addcmul(torch.autograd.Function):
    """a + b · c with gradients (g, g·c, g·b): torch's own backward multiplies b and c by
    `value` first, two more full passes per call (an adaLN block has four such calls)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(b, c)
        ctx.shapes = (a.shape, b.shape, c.shape)
        return torch.addcmul(a, b, c)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, c = ctx.saved_tensors
        sa, sb, sc = ctx.shapes
        ga = grad.sum_to_size(sa) if ctx.needs_input_grad[0] else None
        gb = (grad * c).sum_to_size(sb) if ctx.needs_input_grad[1] else None
        gc = (grad * b).sum_to_size(sc) if ctx.needs_input_grad[2] else None
        return ga, gb, gc


def addcmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a + b · c (broadcasting), one pass forward, two backward. Used for adaLN's modulate
    (shift + x · (1 + scale)) and gated residual (x + gate · out)."""
    return _Addcmul.apply(a, b, c)


class _GatedResidual(torch.autograd.Function):
    """x + gate[index] · y with the per-token gather inside: saves the per-sample table
    [S+1, d], the index [L] and y, not the gathered [L, d] gate. Gradients as autograd gives
    for `addcmul(x, gate.index_select(0, index), y)`: g, index_add of g·y into a zero table
    (index_select's backward), g · gate[index]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, index, y)
        ctx.x_shape = x.shape
        return gated_residual_value(x, gate, index, y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, index, y = ctx.saved_tensors
        gx = grad.sum_to_size(ctx.x_shape) if ctx.needs_input_grad[0] else None
        gg = grad.new_zeros(gate.shape).index_add_(0, index, grad * y) if ctx.needs_input_grad[1] else None
        gy = grad * gate.index_select(0, index) if ctx.needs_input_grad[3] else None
        return gx, gg, None, gy


def gated_residual_value(x: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The value of `gated_residual` (no autograd of its own): what a consumer that rebuilds
    the residual in backward instead of saving it recomputes, bit for bit."""
    return torch.addcmul(x, gate.index_select(0, index), y)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """adaLN-zero's gated residual x + gate[index] · y. x, y: [L, d]; gate: [S+1, d] per
    sample; index: [L] int64 row of each token."""
    if not fused_enabled():
        return addcmul(x, gate.index_select(0, index), y)
    return _GatedResidual.apply(x, gate, index, y)
