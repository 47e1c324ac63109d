"""Rotary position embedding over several position axes (t, h, w for video; one for text)."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Maps integer positions [L, A] to (cos, sin) [L, head_dim/2].

    The head dimension's rotation pairs are split across the A axes (the first axis takes the
    remainder), each axis with its own frequency ladder. Frequencies are recomputed on every
    call instead of stored as buffers, so the module has no state to initialise after a
    meta-device build and nothing to checkpoint.
    """

    def __init__(self, head_dim: int, axes: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE (model.dim / model.heads)")
        pairs = head_dim // 2
        if pairs < axes:
            raise ValueError(f"head_dim={head_dim} is too small for {axes} RoPE axes")
        self.split = [pairs // axes] * axes
        self.split[0] += pairs - sum(self.split)
        self.theta = theta

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = []
        for axis, n in enumerate(self.split):
            inv_freq = self.theta ** (-torch.arange(n, device=pos.device, dtype=torch.float32) / n)
            angles.append(pos[:, axis, None].float() * inv_freq[None, :])
        ang = torch.cat(angles, dim=-1)  # [L, head_dim/2]
        return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [L, H, D] rotated pairwise (x1, x2) -> (x1·c - x2·s, x1·s + x2·c), by -angle if
    `inverse`; computed in fp32 (cos/sin dtype), returned in x's dtype. Functional ops only
    (no `out=`): torch.compile (`train.compile`) must be able to trace it with dynamic shapes."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    sign = -1.0 if inverse else 1.0
    o1 = torch.addcmul(x1 * c, x2, s, value=-sign)
    o2 = torch.addcmul(x2 * c, x1, s, value=sign)
    return torch.cat([o1, o2], dim=-1).to(x.dtype)


class _Rope(torch.autograd.Function):
    """RoPE with its backward written out: a rotation's gradient is the inverse rotation of
    the incoming gradient. Autograd of the elementwise form would save x and run twice the
    elementwise passes (two products per term) plus a concatenation; this saves nothing but
    the (shared) cos/sin."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [L, H, D] by per-token angles; cos/sin [L, D/2] (split-half convention).
    Positions carry no gradient: cos/sin get none."""
    return _Rope.apply(x, cos, sin)
