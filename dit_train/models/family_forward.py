"""Pieces the diffusers families' packed forwards share (models/wan.py, ltx.py, hunyuan15.py):
the per-token time rows, the caption batch, the plain holders diffusers blocks pass on to their
attention processors untouched, and the modules a packed model takes over from a diffusers one.

Every family's packed model has one forward over a flat token sequence of several clips:

    forward(x, pos, seg, t, meta, context=None, context_len=None, clean=None, **family's own) -> [L, C·pt·ph·pw]
      x:    [L, C_in·pt·ph·pw]  noisy patches (+ concat conditioning channels), features (c, pt, ph, pw)
      pos:  [L, 3]  (t, h, w) patch coordinates inside each clip
      seg:  [L]     clip of each token (-1 = padding)
      t:    [S]     flow time of each clip in [0, 1]
      meta: attention metadata for `attention_fn` (VarlenLayout, or CPAttnLayout under CP)
      context: [S, Lc, text_dim] caption embeddings (valid tokens first); None = one all-zero token
      context_len: [S] int64 valid caption tokens
      clean: [L] bool tokens given clean (cond.feed=timestep): their clip's embedding at t = 0
    returning the predicted velocity of every token.

No parallelism here (no torch.distributed).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from dit_train.kernels import LocalAttention

# The families' time embeddings were trained on scheduler timesteps t·num_train_timesteps
# (noise at t = 1, as our flow time).
NUM_TRAIN_TIMESTEPS = 1000.0


def time_rows(t: torch.Tensor, seg: torch.Tensor, clean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [L], timestep [R]): the scheduler timestep of each time-embedding row, and the row each
    token reads. t [S] flow times, seg [L] clip of each token (-1 padding), clean [L] bool tokens
    given clean (cond.feed=timestep) or None.

    Rows 0..S-1 are the clips at their t; without `clean` row S (t = 0) serves the padding tokens
    (R = S + 1). With it, rows S..2S-1 are each clip at t = 0, read by its clean context tokens, and
    row 2S the padding (R = 2S + 1): Wan 2.2's `expand_timesteps`, LTX 0.9.5+'s per-token path."""
    S = t.shape[0]
    if clean is None:
        row = torch.where(seg < 0, torch.full_like(seg, S), seg)
        timestep = torch.cat([t.float(), t.new_zeros(1, dtype=torch.float32)]) * NUM_TRAIN_TIMESTEPS
    else:
        row = torch.where(seg < 0, torch.full_like(seg, 2 * S), seg + S * clean.to(seg.dtype))
        timestep = torch.cat([t.float(), t.new_zeros(S + 1, dtype=torch.float32)]) * NUM_TRAIN_TIMESTEPS
    return row, timestep


def caption_batch(context: torch.Tensor | None, context_len: torch.Tensor | None, S: int, text_dim: int,
                  like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The S clips' captions [S, Lc, text_dim] and valid lengths [S] as a diffusers text branch
    takes them: no captions = one all-zero token per clip; no lengths = every token valid."""
    if context is None:
        context = like.new_zeros(S, 1, text_dim)
        context_len = torch.ones(S, dtype=torch.long, device=like.device)
    if context.shape[0] != S or context.shape[-1] != text_dim:
        raise ValueError(f"context {tuple(context.shape)} must be [{S}, Lc, model.text_dim={text_dim}]")
    if context_len is None:
        context_len = torch.full((S,), context.shape[1], dtype=torch.long, device=context.device)
    return context, context_len


class PackedRope:
    """What a diffusers block passes untouched to its self-attention as the rotary embedding: the
    per-token rotation (cos, sin: [L, D'] each) and the attention metadata. A plain class, not a
    dataclass, so FSDP's input cast leaves the fp32 angles alone (diffusers keeps RoPE in fp32 too)."""

    __slots__ = ("cos", "sin", "meta")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, meta: Any):
        self.cos, self.sin, self.meta = cos, sin, meta


class PackedContext:
    """What a diffusers block passes untouched to its cross-attention as `encoder_hidden_states`.

    states: [S, Lc, dim] embedded captions; seg: [L] clip of each (local) token, -1 padding;
    lengths: [S] int64 caption tokens each clip attends to; image: [S, Li, dim] embedded image
    tokens of each clip (Wan 2.1 I2V's CLIP branch), or None.
    """

    __slots__ = ("states", "seg", "lengths", "image")

    def __init__(self, states: torch.Tensor, seg: torch.Tensor, lengths: torch.Tensor, image: torch.Tensor | None = None):
        self.states, self.seg, self.lengths, self.image = states, seg, lengths, image


def take_modules(model: nn.Module, ref: nn.Module, names: Sequence[str]) -> None:
    """Hold `ref`'s submodules `names` under the same names, in that order (the order of the state
    dict and of the parameters): our state dict is then diffusers'."""
    for name in names:
        setattr(model, name, getattr(ref, name))


def packed_processors(blocks: nn.ModuleList, processor: Callable[[], Any], backend: str) -> None:
    """Give each block's attn1 (self) and attn2 (cross) a packed `processor()`, and attn1 a
    swappable self-attention (`attention_fn`, swapped for CP by parallelize())."""
    for block in blocks:
        block.attn1.set_processor(processor())
        block.attn2.set_processor(processor())
        block.attn1.attention_fn = LocalAttention(backend)


def cross_attention_linears(block: nn.Module, ff: nn.Module) -> list[nn.Module]:
    """ModelSpec.block_linears of a block with self-attention attn1, cross-attention attn2 and the
    feed-forward `ff`: the matmuls it applies to every video token (attn2's to_k/to_v act on
    caption tokens only)."""
    a1, a2 = block.attn1, block.attn2
    return [a1.to_q, a1.to_k, a1.to_v, a1.to_out[0], a2.to_q, a2.to_out[0], ff.net[0].proj, ff.net[2]]


def joint_attention_linears(block: nn.Module) -> list[nn.Module]:
    """ModelSpec.block_linears of a block with one attention `attn` over a joint sequence and the
    feed-forward `ff` (HunyuanVideo 1.5's video stream, MiniMax-H3): the matmuls it applies to every
    token it is given."""
    a = block.attn
    return [a.to_q, a.to_k, a.to_v, a.to_out[0], block.ff.net[0].proj, block.ff.net[2]]
