"""Transformer building blocks shared by the video DiT and the causal LM.

Everything works on one packed sequence: activations are [L, dim] with no batch axis; which
sample a token belongs to travels in the attention metadata and the conditioning index.
No parallelism here: the attention layer calls whatever `attention_fn` it holds (single-device
by default, swapped for a context-parallel one by `dit_train.parallel.parallelize`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.models.fused import RMSNorm, addcmul, gated_residual, gated_residual_value, rms_norm
from dit_train.models.moe import MoEFeedForward
from dit_train.models.recompute import Prologue, prologue_switch, recomputed_linear
from dit_train.models.rope import apply_rope
from dit_train.kernels import LocalAttention, packed_cross_attention


@dataclass
class Conditioning:
    """Per-sample conditioning broadcast to tokens.

    per_sample: [R, C] — rows the tokens read: one per sample of the pack, then (per-token
        timesteps) one per sample at timestep 0, then a last all-zero row for padding.
    index: [L] int64 — the row of each token (padding tokens point at the last row).
    Tables stay per row, never per token: adaLN runs on R rows and tokens gather their row.
    """

    per_sample: torch.Tensor
    index: torch.Tensor

    @staticmethod
    def from_samples(c: torch.Tensor, seg: torch.Tensor, clean: torch.Tensor | None = None,
                     c_clean: torch.Tensor | None = None) -> "Conditioning":
        """c: [S, C] each sample's conditioning; seg: [L]. With `clean` ([L] bool: tokens given
        clean at timestep 0, cond.feed=timestep) those tokens read c_clean [S, C], their sample's
        conditioning at t = 0, instead (rows S..2S−1): per-token timesteps at per-sample cost."""
        S = c.shape[0]
        if clean is None:
            rows = torch.cat([c, c.new_zeros(1, c.shape[1])])
            return Conditioning(rows, torch.where(seg < 0, torch.full_like(seg, S), seg))
        rows = torch.cat([c, c_clean, c.new_zeros(1, c.shape[1])])
        index = torch.where(seg < 0, torch.full_like(seg, 2 * S), seg + S * clean.to(seg.dtype))
        return Conditioning(rows, index)

    @staticmethod
    def from_blocks(c: torch.Tensor, seg: torch.Tensor, block: torch.Tensor) -> "Conditioning":
        """Per-block timesteps (diffusion forcing): c [S, B, C], the conditioning of each block of
        each sample; seg, block: [L] each token's sample and causal block. Rows S·B (sample-major),
        then the padding row: adaLN still runs per row, never per token."""
        S, B = c.shape[:2]
        rows = torch.cat([c.reshape(S * B, c.shape[-1]), c.new_zeros(1, c.shape[-1])])  # S = 0: an empty pack
        return Conditioning(rows, torch.where(seg < 0, torch.full_like(seg, S * B), seg * B + block))


def modulation_tables(per_sample: torch.Tensor, chunks: int, scale_at: tuple[int, ...]) -> list[torch.Tensor]:
    """Per-sample adaLN outputs [S+1, chunks·d] -> `chunks` per-sample tables [S+1, d], with
    the `1 + scale` of the chunks in `scale_at` added per *sample* (one [L, d] pass fewer than
    adding it per token). Tokens read their row through an index (`modulate`,
    `fused.gated_residual`): the [L, d] gathers then exist only transiently, never saved."""
    d = per_sample.shape[-1] // chunks
    one = per_sample.new_zeros(chunks, d)
    one[list(scale_at)] = 1.0
    return list((per_sample + one.reshape(-1)).chunk(chunks, dim=-1))


def modulation(per_sample: torch.Tensor, index: torch.Tensor, chunks: int, scale_at: tuple[int, ...]) -> list[torch.Tensor]:
    """`modulation_tables` gathered per token: `chunks` tensors [L, d].

    Chunked per sample first, then each chunk gathered on its own: the backward of a gather
    is a scatter-add into the small [S+1, d] table, whereas gathering [L, chunks·d] and
    chunking that would make the backward concatenate `chunks` [L, d] gradients along the
    last axis (a large strided copy: ~15% of a CPU step on a 5M-parameter DiT)."""
    return [c.index_select(0, index) for c in modulation_tables(per_sample, chunks, scale_at)]


def _modulate(norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale1p: torch.Tensor,
              index: torch.Tensor) -> torch.Tensor:
    return addcmul(shift.index_select(0, index), norm(x), scale1p.index_select(0, index))


def modulate(norm: nn.Module, shift: torch.Tensor, scale1p: torch.Tensor, index: torch.Tensor) -> Prologue:
    """adaLN's modulate, shift[index] + norm(x) · scale1p[index], as the prologue of the next
    linear layer (recomputed in backward, not saved). `norm` must hold no parameters (DiT's
    LayerNorm without affine): parameters have to be prologue arguments."""
    return Prologue(functools.partial(_modulate, norm), (shift, scale1p, index))


def _layer_norm(shape: tuple[int, ...], eps: float, x: torch.Tensor, weight, bias) -> torch.Tensor:
    return F.layer_norm(x, shape, weight, bias, eps)


def _rms_norm(shape: tuple[int, ...], eps: float | None, x: torch.Tensor, weight) -> torch.Tensor:
    return rms_norm(x, weight, shape, eps)


def norm_prologue(norm: nn.Module) -> Prologue:
    """A LayerNorm / RMSNorm module as the prologue of the next linear layer, its parameters
    passed as arguments (they get their gradients through the fused op)."""
    if isinstance(norm, nn.LayerNorm):
        return Prologue(functools.partial(_layer_norm, tuple(norm.normalized_shape), norm.eps), (norm.weight, norm.bias))
    if isinstance(norm, RMSNorm):
        return Prologue(functools.partial(_rms_norm, tuple(norm.normalized_shape), norm.eps), (norm.weight,))
    raise TypeError(f"no prologue for {type(norm).__name__}")


class Attention(nn.Module):
    """Multi-head self-attention with optional QK-RMSNorm and RoPE.

    x: [L, dim] -> [L, dim]. `attention_fn(q, k, v, meta)` takes q/k/v [L, H, Dh].
    `prologue` (the block's norm/modulate) is applied to x inside the qkv projection, which
    then saves x instead of the normalised input (models/recompute.py).
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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: Any,
                prologue: Prologue | None = None) -> torch.Tensor:
        L = x.shape[0]
        q, k, v = recomputed_linear(self.qkv, prologue, x).view(L, 3, self.heads, self.head_dim).unbind(1)
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
    `prologue` (the pre-norm) is applied to x inside the q projection (see Attention);
    `rebuild` says how backward can recompute x itself (models/recompute.py).
    """

    def __init__(self, dim: int, heads: int, qk_norm: bool = True):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.q_norm = RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ctx: TextContext, prologue: Prologue | None = None,
                rebuild: Prologue | None = None) -> torch.Tensor:
        L = x.shape[0]
        S, Lc, _ = ctx.tokens.shape
        q = self.q_norm(recomputed_linear(self.q, prologue, x, rebuild).view(L, self.heads, self.head_dim))
        k, v = self.kv(ctx.tokens).view(S, Lc, 2, self.heads, self.head_dim).unbind(2)
        out = packed_cross_attention(q, self.k_norm(k), v, ctx.seg, ctx.length)
        return self.proj(out.reshape(L, -1))


class MLP(nn.Module):
    """fc2(GELU(fc1(prologue(x)))): [L, dim] -> [L, dim]. fc2 recomputes the GELU of fc1's
    output in backward instead of saving it (an [L, hidden] activation less per block); fc1
    likewise recomputes the block's norm/modulate `prologue` (and x itself with `rebuild`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None, rebuild: Prologue | None = None) -> torch.Tensor:
        return recomputed_linear(self.fc2, Prologue(self.act), recomputed_linear(self.fc1, prologue, x, rebuild))


class Block(nn.Module):
    """Pre-norm transformer block.

    With `cond_dim` it is a DiT block: LayerNorms without affine, modulated per sample by
    adaLN-zero (shift, scale, gate for attention and MLP). Without, a plain pre-RMSNorm block
    (the causal LM). Same attention and MLP either way. With `cross_attention`, a caption
    cross-attention sits between them (pre-LayerNorm, residual, no gate: as in PixArt-α).
    With `moe`, the MLP is a mixture of experts (models/moe.py).
    `recompute_prologues` (model.recompute_prologues): norms, modulate, GELU and the gated
    residual recomputed in backward (less memory) or saved (less compute); same values.
    """

    recompute_prologues: bool = True

    def __init__(
        self, dim: int, heads: int, mlp_ratio: float, cond_dim: int | None, qk_norm: bool = True, backend: str = "sdpa",
        cross_attention: bool = False, moe: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.attn = Attention(dim, heads, qk_norm, backend)
        if cross_attention:
            self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
            self.cross_attn = CrossAttention(dim, heads, qk_norm)
        else:
            self.cross_attn = None
        # moe = (num_experts, top_k): a mixture of experts as wide as the MLP instead of the MLP
        self.mlp = MLP(dim, int(dim * mlp_ratio)) if moe is None else MoEFeedForward(dim, int(dim * mlp_ratio), *moe)
        if cond_dim:
            self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, 6 * dim))
        else:
            self.norm1 = RMSNorm(dim, eps=1e-6)
            self.norm2 = RMSNorm(dim, eps=1e-6)
            self.adaLN_modulation = None

    @prologue_switch
    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: Any, cond: Conditioning | None = None,
        text: TextContext | None = None,
    ) -> torch.Tensor:
        # every norm (and adaLN modulate) runs inside the next linear layer as its prologue, so
        # the block saves the residual stream x, not the normalised copies (models/recompute.py)
        if self.adaLN_modulation is None:
            x = x + self.attn(x, rope, meta, norm_prologue(self.norm1))
            return x + self.mlp(x, norm_prologue(self.norm2))
        # modulation is computed once per sample ([S+1, 6·dim]); tokens read their row by index
        # inside modulate / gated_residual (no [L, dim] gathers kept for backward)
        shift1, scale1p, gate1, shift2, scale2p, gate2 = modulation_tables(
            self.adaLN_modulation(cond.per_sample), 6, scale_at=(1, 4))
        y = self.attn(x, rope, meta, modulate(self.norm1, shift1, scale1p, cond.index))
        # the next layer that reads the residual x + gate1·y rebuilds it from x, gate1 and y
        # (saved anyway) in backward instead of saving it: one [L, dim] activation less
        x, rebuild = gated_residual(x, gate1, cond.index, y), Prologue(gated_residual_value, (x, gate1, cond.index, y))
        if self.cross_attn is not None:
            x, rebuild = x + self.cross_attn(x, text, norm_prologue(self.norm_cross), rebuild), None
        return gated_residual(x, gate2, cond.index, self.mlp(x, modulate(self.norm2, shift2, scale2p, cond.index), rebuild))


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


def feed_forward_linears(ff: nn.Module) -> list:
    """The per-token matmul weights of a block's feed-forward (for FLOPs): fc1 and fc2 of an MLP;
    a mixture of experts' router and the weights of top_k experts (`MoEFeedForward.token_linears`)."""
    return ff.token_linears() if isinstance(ff, MoEFeedForward) else [ff.fc1, ff.fc2]


def block_moe(index: int, moe) -> tuple[int, int] | None:
    """(num_experts, top_k) if block `index` has a mixture of experts under `moe` (a MoEConfig:
    every `moe.every`-th block, counting from 1), else None."""
    if moe.num_experts <= 0 or (index + 1) % max(1, moe.every):
        return None
    return moe.num_experts, moe.top_k
