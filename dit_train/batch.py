"""The packed micro-batch that flows from data to model, and its split across CP ranks."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

# Loss weights are stored as integer multiples of 1/WEIGHT_ONE, so that T_b and N_global (sums
# over a sample's tokens, split over CP ranks and micro-batches) are exact integer sums whatever
# the layout: float sums would depend on the order. 65535 = 255·257: an 8-bit mask value k/255
# is exactly 257·k units, a 16-bit one k/65535 exactly k units; a whole token weighs 65535.
WEIGHT_ONE = 65535

# The streams a sample may have (PackedBatch.stream indexes this): each is reduced by its own
# hierarchical mean, λ_s·(1/B_s)·Σ_b (1/T_{b,s})·Σ_t w·l (dit_train/loss/reductions.py).
STREAMS = ("video", "audio")


def weight_units(w: torch.Tensor) -> torch.Tensor:
    """Float weights w ≥ 0 -> int64 units of 1/WEIGHT_ONE, rounded to the nearest unit (pure:
    the same weights give the same units on every rank)."""
    if bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
        raise ValueError("loss weights must be finite and >= 0")
    return torch.round(w.double() * WEIGHT_ONE).to(torch.int64)


@dataclass
class PackedBatch:
    """Several samples concatenated into one flat sequence of L tokens.

    seg:    [L] int64  index of the token's sample in this pack (0..S-1); -1 = padding
    pos:    [L, A] int64  RoPE coordinates (A = 3: t, h, w for video; A = 1 for text); float32 when a
            two-stream DiT's audio tokens sit at fractional times (tasks/joint_audio.py; the video's
            integer positions are exact in it)
    order:  [L] int64  index of the token inside its sample (causal mask, contiguity check)
    valid:  [L] bool   token carries loss (padding, prompt, ignored labels and context tokens do not)
    weight: [L] int64 or None  loss weight of each token in units of 1/WEIGHT_ONE (w_t ≥ 0: 0 =
            context, fractional = soft mask); None = `valid` as 0/1. When given, valid == weight > 0
            (`with_weight` keeps them together)
    tokens: token-aligned tensors, each [L, ...] (video: x, target; text: ids, labels)
    samples: per-sample tensors, each [S, ...] (video: t; diffusion forcing also block_t [S, B], each
             causal block's t); identical on every CP rank
    sample_ids: [S] int64  dataset ids (keys of the per-sample noise and metadata)
    causal: attention is causal inside each sample, by `mask_order` (the causal LM: `order`)
    block:  [L] int64 or None  the token's causal block when it is not `order` (block-causal video,
            model.causal_block_frames: its temporal block index, equal for every token of a block, so
            that the causal rule pos_k <= pos_q lets a block's tokens see each other); None = `order`
    stream: [L] int64 or None  the token's stream (index into `STREAMS`: 0 video, 1 audio) when a
            sample has several (audio + video, docs/audio-video.md); None = every token stream 0
    """

    seg: torch.Tensor
    pos: torch.Tensor
    order: torch.Tensor
    valid: torch.Tensor
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    causal: bool = False
    weight: torch.Tensor | None = None
    block: torch.Tensor | None = None
    stream: torch.Tensor | None = None

    @property
    def mask_order(self) -> torch.Tensor:
        """[L] int64 the attention layout's causal key: `block` where set, else `order`."""
        return self.order if self.block is None else self.block

    @property
    def num_tokens(self) -> int:
        return self.seg.numel()

    @property
    def num_samples(self) -> int:
        return self.sample_ids.numel()

    def to(self, device: torch.device | str) -> "PackedBatch":
        mv = lambda d: {k: v.to(device, non_blocking=True) for k, v in d.items()}  # noqa: E731
        return replace(self, seg=self.seg.to(device), pos=self.pos.to(device), order=self.order.to(device),
                       valid=self.valid.to(device), tokens=mv(self.tokens), samples=mv(self.samples),
                       sample_ids=self.sample_ids.to(device),
                       weight=None if self.weight is None else self.weight.to(device),
                       block=None if self.block is None else self.block.to(device),
                       stream=None if self.stream is None else self.stream.to(device))

    def pad_to_multiple(self, m: int) -> "PackedBatch":
        """Append padding tokens (seg -1, weight 0) so L is a multiple of m (at least m)."""
        L = self.num_tokens
        n = (-L) % m if L > 0 else m
        if n == 0:
            return self

        def pad(t: torch.Tensor, value=0) -> torch.Tensor:
            return torch.cat([t, t.new_full((n, *t.shape[1:]), value)])

        # padding is one more "sample" (id -1) with its own in-order positions, so causal and
        # bidirectional kernels agree on it too (its tokens carry weight 0 anyway)
        order = torch.cat([self.order, torch.arange(n, dtype=self.order.dtype)])
        block = None if self.block is None else torch.cat([self.block, torch.arange(n, dtype=self.block.dtype)])
        return replace(self, seg=pad(self.seg, -1), pos=pad(self.pos), order=order, block=block,
                       valid=pad(self.valid, False), tokens={k: pad(v) for k, v in self.tokens.items()},
                       weight=None if self.weight is None else pad(self.weight),
                       stream=None if self.stream is None else pad(self.stream))

    def select(self, index: torch.Tensor) -> "PackedBatch":
        """The tokens at `index` (a CP shard); per-sample tensors are kept whole."""
        return replace(self, seg=self.seg[index], pos=self.pos[index], order=self.order[index],
                       valid=self.valid[index], tokens={k: v[index] for k, v in self.tokens.items()},
                       weight=None if self.weight is None else self.weight[index],
                       block=None if self.block is None else self.block[index],
                       stream=None if self.stream is None else self.stream[index])

    def with_weight(self, units: torch.Tensor) -> "PackedBatch":
        """This pack with loss weights `units` ([L] int64, units of 1/WEIGHT_ONE; padding must
        get 0); `valid` becomes weight > 0."""
        if units.shape != self.seg.shape or units.dtype != torch.int64:
            raise ValueError(f"weight must be int64 {tuple(self.seg.shape)}, got {units.dtype} {tuple(units.shape)}")
        return replace(self, weight=units, valid=units > 0)

    def weight_units(self) -> torch.Tensor:
        """[L] int64 loss weight of each token in units of 1/WEIGHT_ONE."""
        if self.weight is not None:
            return self.weight
        return self.valid.to(torch.int64) * WEIGHT_ONE

    def loss_weight(self) -> torch.Tensor:
        """[L] fp32 loss weight w_t of each token (a whole token 1.0 exactly; padding 0)."""
        if self.weight is None:
            return self.valid.to(torch.float32)
        return (self.weight.double() / WEIGHT_ONE).to(torch.float32)

    def local_counts(self) -> torch.Tensor:
        """[S] valid tokens of each sample among this batch's tokens (a CP shard sees a part)."""
        seg = self.seg[self.valid]
        return torch.bincount(seg, minlength=self.num_samples)[: self.num_samples]

    def local_weights(self) -> torch.Tensor:
        """[S] int64 Σ w_t of each sample over this batch's tokens, in units of 1/WEIGHT_ONE (a CP
        shard sees a part, possibly 0: a shard holding only context tokens of a sample)."""
        keep = self.seg >= 0
        out = torch.zeros(self.num_samples, dtype=torch.int64, device=self.seg.device)
        return out.index_add_(0, self.seg[keep], self.weight_units()[keep])

    def local_stream_weights(self, streams: int) -> torch.Tensor:
        """[S, streams] int64 Σ w_t of each (sample, stream) over this batch's tokens, in units of
        1/WEIGHT_ONE (the per-stream `local_weights`; a CP shard may hold none of a sample's audio).
        Row sums are `local_weights`."""
        keep = self.seg >= 0
        stream = torch.zeros_like(self.seg) if self.stream is None else self.stream
        if bool((stream[keep] >= streams).any()) or bool((stream[keep] < 0).any()):
            raise ValueError(f"a token's stream is outside 0..{streams - 1}")
        out = torch.zeros(self.num_samples * streams, dtype=torch.int64, device=self.seg.device)
        out.index_add_(0, self.seg[keep] * streams + stream[keep], self.weight_units()[keep])
        return out.view(self.num_samples, streams)


def input_tokens(batch: PackedBatch) -> torch.Tensor:
    """[L, in] a video model's input tokens of a pack: x, with the concat feed's channels and the
    control video's appended per token (patchify flattens channels outermost, so appending
    features per token is the channel concatenation [noisy | mask | conditioning | control] of
    the patch)."""
    x = batch.tokens["x"]
    extra = [batch.tokens[k].to(x.dtype) for k in ("cond", "control") if k in batch.tokens]
    return torch.cat([x, *extra], dim=-1) if extra else x


def model_context(batch: PackedBatch, captions: str = "context") -> dict[str, torch.Tensor]:
    """The keyword arguments of a video model call besides the tokens: captions
    (samples[captions] [S, Lc, text_dim] and its "_len" [S]; distillation's teacher also reads
    "null_context"), the clean (timestep 0) tokens of the conditioning's timestep feed
    (tokens["clean"] [L] bool), a joint-attention model's text slots (tokens["text"] [L]), the
    clips' CLIP image tokens (samples["image"] [S, Li, image_dim]), a two-stream pack's `stream`
    and its audio tokens' sync feature (tokens["sync"] [L] float); {} for unconditional packs."""
    out = {}
    if captions in batch.samples:
        out = {"context": batch.samples[captions], "context_len": batch.samples[f"{captions}_len"]}
    if "clean" in batch.tokens:
        out["clean"] = batch.tokens["clean"]
    if "text" in batch.tokens:  # text slots of a joint-attention model (tasks/joint_text.py)
        out["text"] = batch.tokens["text"]
    if "image" in batch.samples:  # Wan 2.1 I2V's CLIP image tokens, per clip
        out["image"] = batch.samples["image"]
    if batch.stream is not None:  # the two-stream DiT's audio tokens (tasks/joint_audio.py)
        out["stream"] = batch.stream
    if "sync" in batch.tokens:  # their sync feature (model.sync_encoder, tasks/av_sync.py)
        out["sync"] = batch.tokens["sync"]
    return out


def video_forward(model: Any, batch: PackedBatch, attn: Any, x: torch.Tensor | None = None,
                  t: torch.Tensor | None = None, captions: str = "context") -> torch.Tensor:
    """The one call of a video model on a pack (training, validation, sampling, RL, distillation):
    its output [L, out] for the pack's L tokens, in the model's dtype.

    attn: the pack's attention layout (VarlenLayout, or CP's split of it). x: [L, in] input
    tokens in place of the pack's own (`input_tokens`; distillation's simulated x_j); t: [S]
    noise levels in place of samples["t"]; captions: which per-sample captions the model reads
    ("context", or the empty caption "null_context" of the teacher's guidance). A diffusion-
    forcing pack (samples["block_t"] [S, B], loss.frame_noise=block) gives the model each causal
    block's t and the tokens' `block` instead."""
    x = input_tokens(batch) if x is None else x
    if t is None and "block_t" in batch.samples:
        return model(x, batch.pos, batch.seg, batch.samples["block_t"], attn, block=batch.block,
                     **model_context(batch, captions))
    t = batch.samples["t"] if t is None else t
    return model(x, batch.pos, batch.seg, t, attn, **model_context(batch, captions))


def cp_token_index(L: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Token indices of the pack held by CP rank `rank` of `cp`.

    contiguous: rank r holds [r·L/cp, (r+1)·L/cp) — bidirectional attention costs the same anywhere.
    zigzag: the pack is cut into 2·cp chunks and rank r holds chunks r and 2·cp-1-r, so that
    under a causal mask every rank has the same amount of attention work.
    The split never looks at sample boundaries: a sample may span ranks; who holds which of its
    tokens is known through `seg`, and per-sample lengths are summed over the CP group.
    """
    if layout == "contiguous":
        if L % cp:
            raise ValueError(f"pack length {L} is not a multiple of the CP degree {cp}")
        n = L // cp
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        if L % (2 * cp):
            raise ValueError(f"pack length {L} is not a multiple of 2·CP = {2 * cp}")
        n = L // (2 * cp)
        a, b = rank, 2 * cp - 1 - rank
        return torch.cat([torch.arange(a * n, (a + 1) * n), torch.arange(b * n, (b + 1) * n)])
    raise ValueError(f"unknown CP layout {layout!r}")
