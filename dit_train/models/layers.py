"""Transformer building blocks shared by the video DiT and the causal LM.

Everything works on one packed sequence: activations are [L, dim] with no batch axis; which
sample a token belongs to travels in the attention metadata and the conditioning index.
No parallelism here: the attention layer calls whatever `attention_fn` it holds (single-device
by default, swapped for a context-parallel one by `dit_train.parallel.parallelize`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dit_train.models.fused import RMSNorm, addcmul
from dit_train.models.rope import apply_rope
from kernels import LocalAttention, packed_cross_attention


@dataclass
class Conditioning:
    """Per-sample conditioning broadcast to tokens.

    per_sample: [S + 1, C] — one row per sample of the pack, plus a last all-zero row for padding.
    index: [L] int64 — the row of each token (padding tokens point at the last row).
    """

    per_sample: torch.Tensor
    index: torch.Tensor

    @staticmethod
    def from_samples(c: torch.Tensor, seg: torch.Tensor) -> "Conditioning":
        S = c.shape[0]
        rows = torch.cat([c, c.new_zeros(1, c.shape[1])])
        return Conditioning(rows, torch.where(seg < 0, torch.full_like(seg, S), seg))


def modulation(per_sample: torch.Tensor, index: torch.Tensor, chunks: int, scale_at: tuple[int, ...]) -> list[torch.Tensor]:
    """Per-sample adaLN outputs [S+1, chunks·d] -> `chunks` per-token tensors [L, d], with the
    `1 + scale` of the chunks in `scale_at` added per *sample* before the gather: the same
    values as adding per token, one [L, d] pass fewer each (pair with `fused.addcmul`).

    Chunked per sample first, then each chunk gathered on its own: the backward of a gather
    is a scatter-add into the small [S+1, d] table, whereas gathering [L, chunks·d] and
    chunking that would make the backward concatenate `chunks` [L, d] gradients along the
    last axis (a large strided copy: ~15% of a CPU step on a 5M-parameter DiT)."""
    d = per_sample.shape[-1] // chunks
    one = per_sample.new_zeros(chunks, d)
    one[list(scale_at)] = 1.0
    return [c.index_select(0, index) for c in (per_sample + one.reshape(-1)).chunk(chunks, dim=-1)]


class Attention(nn.Module):
    """Multi-head self-attention with optional QK-RMSNorm and RoPE.

    x: [L, dim] -> [L, dim]. `attention_fn(q, k, v, meta)` takes q/k/v [L, H, Dh].
    """

    def __init__(self, dim: int, heads: int, qk_norm: bool = True, backend: str = "sdpa"):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.dim={dim} must be divisible by model.heads={heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.attention_fn: Callable[..., torch.Tensor] = LocalAttention(backend)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: Any) -> torch.Tensor:
        L = x.shape[0]
        q, k, v = self.qkv(x).view(L, 3, self.heads, self.head_dim).unbind(1)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.attention_fn(q, k, v, meta)
        return self.proj(out.reshape(L, -1))


@dataclass
class TextContext:
    """Caption tokens of the samples of a pack, already embedded to the model width.

    tokens: [S, Lc, dim] — per sample, valid tokens first (zero padded).
    length: [S] int64 — valid tokens of each sample.
    seg:    [L] int64 — sample of each (local) query token, -1 = padding.
    Per-sample, so identical on every CP rank: cross-attention needs no communication.
    """

    tokens: torch.Tensor
    length: torch.Tensor
    seg: torch.Tensor


class CrossAttention(nn.Module):
    """Attention from video tokens to their own sample's caption tokens (PixArt-style).

    x: [L, dim], ctx: TextContext -> [L, dim]. No RoPE: captions and patches share no axis.
    """

    def __init__(self, dim: int, heads: int, qk_norm: bool = True):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.q_norm = RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ctx: TextContext) -> torch.Tensor:
        L = x.shape[0]
        S, Lc, _ = ctx.tokens.shape
        q = self.q_norm(self.q(x).view(L, self.heads, self.head_dim))
        k, v = self.kv(ctx.tokens).view(S, Lc, 2, self.heads, self.head_dim).unbind(2)
        out = packed_cross_attention(q, self.k_norm(k), v, ctx.seg, ctx.length)
        return self.proj(out.reshape(L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block.

    With `cond_dim` it is a DiT block: LayerNorms without affine, modulated per sample by
    adaLN-zero (shift, scale, gate for attention and MLP). Without, a plain pre-RMSNorm block
    (the causal LM). Same attention and MLP either way. With `cross_attention`, a caption
    cross-attention sits between them (pre-LayerNorm, residual, no gate: as in PixArt-α).
    """

    def __init__(
        self, dim: int, heads: int, mlp_ratio: float, cond_dim: int | None, qk_norm: bool = True, backend: str = "sdpa",
        cross_attention: bool = False,
    ):
        super().__init__()
        self.attn = Attention(dim, heads, qk_norm, backend)
        if cross_attention:
            self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
            self.cross_attn = CrossAttention(dim, heads, qk_norm)
        else:
            self.cross_attn = None
        self.mlp = MLP(dim, int(dim * mlp_ratio))
        if cond_dim:
            self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, 6 * dim))
        else:
            self.norm1 = RMSNorm(dim, eps=1e-6)
            self.norm2 = RMSNorm(dim, eps=1e-6)
            self.adaLN_modulation = None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: Any, cond: Conditioning | None = None,
        text: TextContext | None = None,
    ) -> torch.Tensor:
        if self.adaLN_modulation is None:
            x = x + self.attn(self.norm1(x), rope, meta)
            return x + self.mlp(self.norm2(x))
        # modulation is computed once per sample ([S+1, 6·dim]) and gathered per token;
        # addcmul(shift, x, 1 + scale) fuses DiT's x·(1 + scale) + shift (fewer [L, dim] passes)
        shift1, scale1p, gate1, shift2, scale2p, gate2 = modulation(
            self.adaLN_modulation(cond.per_sample), cond.index, 6, scale_at=(1, 4))
        x = addcmul(x, gate1, self.attn(addcmul(shift1, self.norm1(x), scale1p), rope, meta))
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.norm_cross(x), text)
        return addcmul(x, gate2, self.mlp(addcmul(shift2, self.norm2(x), scale2p)))


class TimestepEmbedder(nn.Module):
    """Flow-matching time t ∈ [0, 1] ([S]) -> [S, dim]: sinusoidal features, then an MLP."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = (t.float() * 1000.0)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))
