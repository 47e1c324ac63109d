"""Packed video DiT: one flat sequence of patch tokens from several clips of different sizes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dit_train.config.choices import AudioFeatures, Mode
from dit_train.config.schema import VideoModelConfig
from dit_train.data_pipelines.audio_features import feature_errors, token_width
from dit_train.models import dit_pretrained, sync_encoder
from dit_train.models.layers import (Block, feed_forward_linears, Conditioning, TextContext, TimestepEmbedder, block_moe, modulate,
                                     modulation_tables)
from dit_train.models.recompute import prologue_switch, recomputed_linear
from dit_train.models.registry import ActivationModel, ModelSpec, register_model
from dit_train.models.rope import RotaryEmbedding


@dataclass
class DiTConfig(VideoModelConfig):
    """The packed video DiT (`model.name=dit`): the keys of every video model, plus the pooled caption."""

    name: str = "dit"
    # the mean of the caption's embedded tokens is also added to the timestep embedding, so
    # every adaLN modulation sees the whole caption (SD3's pooled text vector); cross-attention
    # alone leaves clip-wide choices such as the shape's kind to each token (docs/quality.md)
    pooled_text: bool = False
    # latent frames per causal block (a multiple of patch_size[0]); 0 = bidirectional. K > 0: a
    # token attends to the tokens of its own block and of earlier blocks of its clip only (block-
    # causal video, docs/causal.md); the mask lives in the attention layout, so every backend and CP
    # scheme applies it
    causal_block_frames: int = 0
    # waveform samples per audio token; 0 = video only. > 0: the two-stream variant (audio + video,
    # docs/audio-video.md): each clip's sound (data.audio) joins its sequence as tokens of stream 1
    # with their own embedder and output head, attending jointly with the clip's video tokens
    audio_patch: int = 0
    # what an audio token holds: `wave` (its audio_patch samples) or `spectrogram` (their log-
    # magnitude STFT frames: phase-free, so the loss weighs a click against a steady band rather
    # than the tone's phase; decoded with Griffin-Lim; data_pipelines/audio_features.py)
    audio_features: AudioFeatures = AudioFeatures.wave
    # start from a finished run's weights: its folder (EMA weights when present) or a .safetensors
    # file of full weights; '' = initialise from train.seed (models/dit_pretrained.py)
    pretrained: str = ""
    # a sync encoder (tools.train_sync's folder; '' = none): each audio token also gets the
    # probability that a sound event starts at its frame's instant in the clean picture it is
    # given (video-to-audio: cond.given_stream=video), through its own embedding
    # (tasks/av_sync.py, docs/audio-video.md); needs model.audio_patch > 0
    sync_encoder: str = ""
    # that probability enters the DiT times sync_scale: ~ the norm of a noisy audio token (√1028
    # for spectrogram tokens) — at 1, one input beside ~1000 unit-variance noise features is
    # swamped and the click is not made where told (measured, docs/audio-video.md)
    sync_scale: float = 32.0


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm, then a projection back to patch values (the modulate is
    recomputed in the projection's backward, not saved, unless model.recompute_prologues=false)."""

    recompute_prologues: bool = True

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, out_dim)

    @prologue_switch
    def forward(self, x: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        shift, scale1p = modulation_tables(self.adaLN_modulation(cond.per_sample), 2, scale_at=(1,))
        return recomputed_linear(self.linear, modulate(self.norm, shift, scale1p, cond.index), x)


class SyncEmbedder(nn.Module):
    """sync [L] -> [L, dim]: the audio tokens' sync feature (tasks/av_sync.py) times `scale`, projected.

    Its weight is drawn as one more column of the audio embedder would be (xavier over that
    layer's fan-in + 1), so at input `scale` ~ the norm of a noisy audio token it starts at that
    token's scale, and AdamW moves its contribution `scale` times faster than a column read at 1
    (measured: at 1 the DiT did not make the click where told; docs/audio-video.md)."""

    def __init__(self, dim: int, audio_dim: int, scale: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1))
        self.scale, self.fans = scale, audio_dim + 1 + dim

    def init_parameter(self, pname: str, full: torch.Tensor, gen: torch.Generator, scheme: str, std: float) -> torch.Tensor:
        """models/init.py's hook: xavier uniform with the audio embedder's fans (normal under init=normal)."""
        if scheme == "normal":
            return full.normal_(0.0, std, generator=gen)
        bound = (6.0 / self.fans) ** 0.5
        return full.uniform_(-bound, bound, generator=gen)

    def forward(self, sync: torch.Tensor) -> torch.Tensor:
        return (sync * self.scale)[:, None] * self.weight[:, 0]


class VideoDiT(nn.Module):
    """Diffusion transformer over packed (t, h, w) patches.

    forward(x, pos, seg, t, meta, context=None, context_len=None, clean=None):
      x:    [L, in_dim]     noisy patches of every clip in the pack, concatenated (in_dim =
                            patch_dim, plus the concat conditioning's channels: cond_dim)
      pos:  [L, 3]          (t, h, w) patch coordinates inside each clip, for 3-D RoPE
      seg:  [L]             index of the clip in the pack (-1 = padding)
      t:    [S]             flow-matching time of each clip, or [S, B] of each causal block of
                            each clip (diffusion forcing, with `block`)
      meta: attention metadata for the attention callable (VarlenLayout, or its CP variant)
      context:     [S, Lc, text_dim] caption embeddings, valid tokens first (text_dim > 0 only)
      context_len: [S] int64 valid caption tokens of each clip
      clean: [L] bool tokens given clean (cond.feed=timestep context): conditioned on t = 0
      stream: [L] int64 the token's stream (0 video, 1 audio) of a two-stream model (audio_dim >
              0); x is then [L, max(in_dim, audio_dim)]: a video token's first in_dim features,
              an audio token's first audio_dim (its waveform samples), zeros after
      block: [L] int64 each token's causal block (PackedBatch.block), with t [S, B]: a token is
             conditioned on its block's t
      sync: [L] float32 the sync feature of each token (model.sync_encoder: an audio token's
            frame-event probability from its clip's clean picture, tasks/av_sync.py; 0 elsewhere)
    returns [L, patch_dim], the predicted velocity; with `stream`, [L, max(patch_dim, audio_dim)]
    (an audio token's velocity in its first audio_dim values, zeros after; likewise video).
    """

    # parameters that start at zero ("adaLN-zero" of DiT, zero cross-attention output of
    # PixArt-α: a new block starts as the identity); see models/init.py
    zero_init = ("adaLN_modulation", "final.linear", "cross_attn.proj", "text_pool")  # final.linear: audio_final too
    output_head = "final.linear"  # LoRA on a base where it is all zero cannot learn (engine/sanity.py)

    def __init__(self, patch_dim: int, dim: int, depth: int, heads: int, mlp_ratio: float,
                 qk_norm: bool = True, rope_theta: float = 10000.0, backend: str = "sdpa", text_dim: int = 0,
                 moe_blocks: list | None = None, pooled_text: bool = False, cond_dim: int = 0, audio_dim: int = 0,
                 sync_scale: float = 0.0):
        super().__init__()
        self.patch_dim, self.audio_dim = patch_dim, audio_dim
        self.text_dim = text_dim
        self.x_embedder = nn.Linear(patch_dim + cond_dim, dim)
        self.t_embedder = TimestepEmbedder(dim)
        # caption embeddings (any encoder width) -> model width, as PixArt's caption projection
        self.context_embedder = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"),
                                              nn.Linear(dim, dim)) if text_dim else None
        # pooled caption -> conditioning vector (starts at zero: the model starts as without it)
        self.text_pool = nn.Linear(dim, dim) if text_dim and pooled_text else None
        self.rope = RotaryEmbedding(dim // heads, axes=3, theta=rope_theta)
        moe_blocks = moe_blocks or [None] * depth  # per block: (num_experts, top_k) or None (dense MLP)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, dim, qk_norm, backend, cross_attention=bool(text_dim),
                                          moe=moe_blocks[i]) for i in range(depth))
        self.final = FinalLayer(dim, patch_dim)
        # the audio stream's own way in and out (the blocks are shared: one joint sequence per clip)
        self.audio_embedder = nn.Linear(audio_dim, dim) if audio_dim else None
        self.audio_final = FinalLayer(dim, audio_dim) if audio_dim else None
        # the sync feature's own embedding (model.sync_encoder; 0 = none)
        self.sync_embedder = SyncEmbedder(dim, audio_dim, sync_scale) if audio_dim and sync_scale else None

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                context: torch.Tensor | None = None, context_len: torch.Tensor | None = None,
                clean: torch.Tensor | None = None, stream: torch.Tensor | None = None,
                block: torch.Tensor | None = None, sync: torch.Tensor | None = None) -> torch.Tensor:
        # inputs arrive in fp32 (FSDP2's root does not cast them, see parallel.fsdp_mp_policies)
        x = x.to(self.x_embedder.weight.dtype)
        h = self.x_embedder(x[:, : self.x_embedder.in_features])
        audio = None
        if stream is not None and self.audio_embedder is not None:
            audio = (stream == 1)[:, None]
            a = self.audio_embedder(x[:, : self.audio_dim])
            if self.sync_embedder is not None and sync is not None:
                a = a + self.sync_embedder(sync.to(h.dtype))
            h = torch.where(audio, a, h)
        if t.dim() == 2:  # per-block t: every (clip, block) is one conditioning row
            return self._blocks_forward(h, pos, seg, t, meta, context, context_len, clean, block, audio)
        S = t.shape[0]
        # clean context tokens read their sample's rows at t = 0 (one embedding pass for both)
        c = self.t_embedder(t if clean is None else torch.cat([t, torch.zeros_like(t)]))
        rope = self.rope(pos)
        text, pool = self._text(context, context_len, seg, h.dtype)
        if pool is not None:
            c = c + (pool if clean is None else torch.cat([pool, pool]))
        cond = Conditioning.from_samples(c, seg) if clean is None else \
            Conditioning.from_samples(c[:S], seg, clean, c[S:])
        return self._trunk(h, rope, meta, cond, text, audio)

    def _text(self, context: torch.Tensor | None, context_len: torch.Tensor | None, seg: torch.Tensor,
              dtype: torch.dtype) -> tuple[TextContext | None, torch.Tensor | None]:
        """The captions as cross-attention context, and their pooled vector [S, dim] (None without)."""
        if self.context_embedder is None:
            return None, None
        if context is None:
            raise ValueError("this model has text cross-attention (model.text_dim > 0) but the batch has no captions")
        text = TextContext(self.context_embedder(context.to(dtype)), context_len, seg)
        return text, self.text_pool(pooled(text)) if self.text_pool is not None else None

    def _blocks_forward(self, h, pos, seg, t, meta, context, context_len, clean, block, audio) -> torch.Tensor:
        """forward with t [S, B]: the timestep embedding (plus the pooled caption) of every block
        of every clip, one adaLN row each (Conditioning.from_blocks)."""
        if block is None or clean is not None:
            raise ValueError("per-block timesteps t [S, B] need the tokens' `block` and no clean tokens")
        S, B = t.shape
        c = self.t_embedder(t.reshape(-1))
        c = c.reshape(S, B, c.shape[-1])  # not -1: an empty pack (S = 0, a DP rank's empty micro-batch) has no size to infer
        text, pool = self._text(context, context_len, seg, h.dtype)
        if pool is not None:
            c = c + pool[:, None]
        return self._trunk(h, self.rope(pos), meta, Conditioning.from_blocks(c, seg, block), text, audio)

    def _trunk(self, h, rope, meta, cond: Conditioning, text: TextContext | None,
               audio: torch.Tensor | None) -> torch.Tensor:
        """The blocks and the output layer; audio [L, 1] bool marks a two-stream model's audio
        tokens (their own output layer), None for a video-only pack."""
        for block in self.blocks:
            h = block(h, rope, meta, cond, text)
        if audio is None:
            return self.final(h, cond)
        width = max(self.patch_dim, self.audio_dim)
        pad = lambda y: nn.functional.pad(y, (0, width - y.shape[-1]))  # noqa: E731
        return torch.where(audio, pad(self.audio_final(h, cond)), pad(self.final(h, cond)))


def pooled(text: TextContext) -> torch.Tensor:
    """Mean of each sample's valid caption tokens: [S, Lc, dim] -> [S, dim] (per sample, so the
    same on every CP rank)."""
    valid = torch.arange(text.tokens.shape[1], device=text.tokens.device)[None] < text.length[:, None]
    valid = valid.to(text.tokens.dtype)
    return (text.tokens * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp(min=1)


def patch_dim(cfg: VideoModelConfig) -> int:
    return cfg.in_channels * math.prod(cfg.patch_size)


def input_dim(cfg: VideoModelConfig) -> int:
    """Features of an input token: the patch, plus the concat conditioning's channels."""
    return (cfg.in_channels + cfg.cond_channels) * math.prod(cfg.patch_size)


def build(cfg: DiTConfig, attn_backend: str = "sdpa") -> VideoDiT:
    return VideoDiT(patch_dim=patch_dim(cfg), cond_dim=input_dim(cfg) - patch_dim(cfg), dim=cfg.dim, depth=cfg.depth,
                    heads=cfg.heads, mlp_ratio=cfg.mlp_ratio,
                    qk_norm=cfg.qk_norm, rope_theta=cfg.rope_theta, backend=attn_backend, text_dim=cfg.text_dim,
                    moe_blocks=[block_moe(i, cfg.moe) for i in range(cfg.depth)], pooled_text=cfg.pooled_text,
                    audio_dim=token_width(cfg.audio_patch, cfg.audio_features),  # 0: video only
                    sync_scale=cfg.sync_scale if cfg.sync_encoder else 0.0)


def _checks(cfg: DiTConfig) -> list[str]:
    return _shape_errors(cfg) or dit_pretrained.errors(cfg, lambda: build(cfg))


def _shape_errors(cfg: DiTConfig) -> list[str]:
    if len(cfg.patch_size) != 3 or any(x < 1 for x in cfg.patch_size):
        return [f"model.patch_size={list(cfg.patch_size)} must be three positive ints [t, h, w]"]
    if cfg.pooled_text and cfg.text_dim <= 0:
        return ["model.pooled_text=true pools the caption: set model.text_dim > 0 (captions) or model.pooled_text=false"]
    if cfg.audio_patch < 0 or (cfg.audio_patch and (cfg.causal_block_frames or cfg.cond_channels)):
        return [f"model.audio_patch={cfg.audio_patch} must be >= 0; the two-stream variant trains bidirectional, "
                "unconditioned models only (model.causal_block_frames=0, cond.kind=none)"]
    features = feature_errors(cfg.audio_patch, cfg.audio_features) if cfg.audio_patch else []
    if features:
        return features
    if cfg.sync_encoder:
        errors = sync_errors(cfg)
        if errors:
            return errors
    k, pt = cfg.causal_block_frames, cfg.patch_size[0]
    if k < 0 or k % pt:
        return [f"model.causal_block_frames={k} must be 0 (bidirectional) or a positive multiple of "
                f"model.patch_size[0]={pt} (a causal block holds whole temporal patches)"]
    return []


def sync_errors(cfg: DiTConfig) -> list[str]:
    """model.sync_encoder: a two-stream pixel-space model and a file that loads (before any worker starts)."""
    where = f"model.sync_encoder={cfg.sync_encoder}"
    if not cfg.audio_patch:
        return [f"{where} feeds the audio tokens: it needs the two-stream DiT (model.audio_patch=500 data.audio=true)"]
    if cfg.in_channels != 3:
        return [f"{where} reads pixels (model.in_channels=3), not {cfg.in_channels}-channel latents"]
    try:
        sync_encoder.load(cfg.sync_encoder)
    except FileNotFoundError as err:
        return [f"{where}: {err}"]
    except Exception as err:  # noqa: BLE001 - not an encoder tools.train_sync wrote: one line, not a traceback
        return [f"{where}: cannot load it as a sync encoder ({type(err).__name__}: {str(err)[:160]})"]
    return []


def _activations(cfg: DiTConfig) -> ActivationModel:
    """Saved per token per block, read off the autograd graph of layers.Block with the
    recomputed prologues (models/recompute.py): residual in, qkv (3), RoPE'd q/k (2), attention
    out in SDPA layout and packed (2), proj out, the gated residual's MLP output, fc1 out (h;
    GELU, norms, modulate recomputed) — 10·d + h, all in the compute dtype (the residual stream
    is). Caption cross-attention adds ~5.4·d (q and normed q, attention out, projection, and
    per-sample K/V spread over the tokens). Fitted with perf.memory.calibrate_block at d = 64,
    128 and with the Wan-shaped presets of tools/bench_activations (h ≠ 4·d).
    With model.recompute_prologues=false the block also keeps the normalised/modulated inputs
    of qkv and fc1, their per-token shift/scale gathers, the gate gather, the residual and the
    GELU output: +9·d + h (+1·d for the caption's normed query), and the final layer +3·d;
    selective checkpointing recomputes all of them either way (same calibration)."""
    extra = 5.4 if cfg.text_dim else 0
    off = float(not cfg.recompute_prologues)
    saved = 10 + extra + off * (9 + bool(cfg.text_dim))
    return ActivationModel(fp32_d=saved, autocast_f32_d=0, autocast_lp_d=saved, h_elems=1 + off, outside_d=6 + 3 * off,
                           selective_d=7 + 3.9 * bool(cfg.text_dim),
                           # a MoE block has no fc1 prologue input, GELU output or gathers of the dense MLP
                           moe_dense_d=4 * off, moe_dense_h=off)


register_model(ModelSpec(
    name="dit", config=DiTConfig, mode=Mode.video, build=build, checks=_checks, moe=True,
    pretrained=dit_pretrained.read,
    # read off the autograd graph of layers.Block (adaLN DiT block; see perf/memory.py for the list)
    activations=_activations,
    block_linears=lambda b: [b.attn.qkv, b.attn.proj, *feed_forward_linears(b.mlp)],
    io_linears=lambda m: [m.x_embedder, m.final.linear],
    io_dim=input_dim, hidden=lambda cfg: int(cfg.dim * cfg.mlp_ratio),
    lora_targets=("attn.qkv", "attn.proj", "cross_attn.q", "cross_attn.kv", "cross_attn.proj", "mlp.fc1", "mlp.fc2"),
))
