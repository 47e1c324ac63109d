"""Packed video DiT: one flat sequence of patch tokens from several clips of different sizes."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dit_train.models.layers import Block, Conditioning, TimestepEmbedder, modulation
from dit_train.models.rope import RotaryEmbedding


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm, then a projection back to patch values."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        shift, scale1p = modulation(self.adaLN_modulation(cond.per_sample), cond.index, 2, scale_at=(1,))
        return self.linear(torch.addcmul(shift, self.norm(x), scale1p))


class VideoDiT(nn.Module):
    """Diffusion transformer over packed (t, h, w) patches.

    forward(x, pos, seg, t, meta):
      x:    [L, patch_dim]  noisy patches of every clip in the pack, concatenated
      pos:  [L, 3]          (t, h, w) patch coordinates inside each clip, for 3-D RoPE
      seg:  [L]             index of the clip in the pack (-1 = padding)
      t:    [S]             flow-matching time of each clip
      meta: attention metadata for the attention callable (VarlenMeta, or its CP variant)
    returns [L, patch_dim], the predicted velocity.
    """

    # parameters that DiT initialises to zero ("adaLN-zero"); see models/init.py
    zero_init = ("adaLN_modulation", "final.linear")

    def __init__(self, patch_dim: int, dim: int, depth: int, heads: int, mlp_ratio: float,
                 qk_norm: bool = True, rope_theta: float = 10000.0, backend: str = "sdpa"):
        super().__init__()
        self.patch_dim = patch_dim
        self.x_embedder = nn.Linear(patch_dim, dim)
        self.t_embedder = TimestepEmbedder(dim)
        self.rope = RotaryEmbedding(dim // heads, axes=3, theta=rope_theta)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, dim, qk_norm, backend) for _ in range(depth))
        self.final = FinalLayer(dim, patch_dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any) -> torch.Tensor:
        h = self.x_embedder(x)
        cond = Conditioning.from_samples(self.t_embedder(t), seg)
        rope = self.rope(pos)
        for block in self.blocks:
            h = block(h, rope, meta, cond)
        return self.final(h, cond)
