"""diffusers' WanTransformer3DModel trained through our packed path.

`PackedWan` holds the very submodules of a diffusers `WanTransformer3DModel` under the same
names (patch_embedding, condition_embedder, blocks.N.*, norm_out, proj_out,
scale_shift_table), so its state dict IS a diffusers state dict: pretrained folders load
1:1 and trained weights export back with `save_pretrained`. Only the forward is ours, so that
several clips of different sizes share one flat token sequence and every parallelism of
dit_train (FSDP2 over `.blocks`, Ulysses/ring CP through `attention_fn`) applies unchanged:

- patch embedding: the Conv3d (kernel = stride = patch) is a linear map on our (c, pt, ph, pw)
  patch features, so its weight is used flattened;
- time: one embedding per clip (Wan's time embedding expects t·1000, t the flow time with
  noise at t = 1, as ours), gathered per token and given to diffusers' own
  `WanTransformerBlock.forward` through its per-token path (temb [1, L, 6, dim], the one
  Wan 2.2 TI2V uses); clean context tokens of the timestep-fed conditioning read their clip's
  embedding at t = 0 (one more row per clip, as Wan 2.2's `expand_timesteps`);
- concat conditioning: the patch embedding is wider (model.cond_channels more input channels,
  diffusers' Wan 2.1 I2V order [noisy | mask | condition]); the output is not;
- 3-D RoPE: WanRotaryPosEmbed's frequencies, computed from each token's (t, h, w) instead of
  one grid per batch;
- attention: the blocks' WanAttention modules get `PackedWanAttnProcessor` (diffusers'
  processor extension point): self-attention calls `attn1.attention_fn` (varlen inside each
  clip; swapped for CP by parallelize), cross-attention attends each token to its own clip's
  caption with `dit_train.kernels.packed_cross_attention`;
- output: proj_out's features are (pt, ph, pw, c) in diffusers; reordered to our (c, pt, ph, pw).

No parallelism here (no torch.distributed).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.config.choices import Mode
from dit_train.config.schema import VideoModelConfig
from dit_train.models.registry import ActivationModel, ModelSpec, register_model
from dit_train.models.wan_experts import (BOTH, components, expert_blocks, expert_checks, ExpertPair, experts_of,
                                         pretrained_folder, sampling_boundary, SUBFOLDER, timestep_range)
from dit_train.kernels import LocalAttention, packed_cross_attention

log = logging.getLogger(__name__)


@dataclass
class WanConfig(VideoModelConfig):
    """diffusers' WanTransformer3DModel through the packed path (`model.name=wan`)."""

    name: str = "wan"
    # Local diffusers folder (config.json + safetensors of a WanTransformer3DModel, or a pipeline
    # folder holding transformer/) to start from; "" = initialise from train.seed. Its shape
    # must match the keys of this node.
    pretrained: str = ""
    ffn_dim: int = 0  # feed-forward width; 0 = dim * mlp_ratio
    freq_dim: int = 256  # sinusoidal timestep features
    cross_attn_norm: bool = True  # affine LayerNorm before cross-attention
    norm_eps: float = 1e-6
    # Cross-attention sees the caption zero-padded to text_len, as Wan was trained (and as
    # diffusers' WanPipeline feeds it); false: only the context_len valid tokens.
    attend_padded_context: bool = True
    # model.pretrained must hold safetensors weights (a pickle can run code on load); true also
    # accepts .bin/.pt weights from a source you trust
    allow_pickle_weights: bool = False
    # (t, h, w) compression of the VAE whose latents the model trains on: the planner's pixel
    # clip -> tokens (Wan 2.1 VAE [4, 8, 8]; Wan 2.2 TI2V's VAE [4, 16, 16])
    vae_stride: List[int] = field(default_factory=lambda: [4, 8, 8])
    # Wan 2.2 A14B: which of the two experts this run trains (models/wan_experts.py). "" = one
    # transformer for every t; high = diffusers' `transformer` (t >= boundary_ratio), low =
    # `transformer_2` (t < boundary_ratio): its flow times are drawn in that range; both = the
    # two in one run, each clip trained by the expert its drawn t selects
    expert: str = ""
    boundary_ratio: float = 0.0  # diffusers' WanPipeline boundary_ratio (A14B T2V: 0.875); used with model.expert
    # Wan 2.1 I2V's CLIP image branch: width of the image tokens (CLIP ViT-H penultimate hidden
    # states: 1280); 0 = none. Adds condition_embedder.image_embedder and, per block, a second
    # cross-attention over the clip's image tokens (attn2.add_k_proj / add_v_proj / norm_added_k)
    image_dim: int = 0
    # Wan 2.1 FLF2V: learnt positions of the first and last images' tokens (2 x 257 = 514); 0 = none
    pos_embed_seq_len: int = 0
    # channels of the concat feed's mask: 1 (one per frame), or the VAE's temporal stride
    # vae_stride[0] = 4, diffusers' Wan 2.1 I2V layout (each latent frame's mask over its 4 video
    # frames; the condition channels then come from the latent cache's `cond_latents`)
    mask_channels: int = 1

    def timestep_range(self) -> tuple[float, float]:
        """(lo, hi) of the flow times this model trains on (tasks/video.py draws them there)."""
        return timestep_range(self)

    def sampling_boundary(self) -> float:
        """The flow time where this model's own sampling switches experts (0 = never)."""
        return sampling_boundary(self)

    def diffusers_model(self) -> type:
        """The diffusers class whose modules (and state dict) the packed model holds."""
        from diffusers import WanTransformer3DModel  # deferred: diffusers takes ~2 s to import; only Wan models need it

        return WanTransformer3DModel

    def diffusers_kwargs(self) -> dict[str, Any]:
        """diffusers_model()(**kwargs) of the same shape as this config."""
        return wan_config(self)

    def widens_pretrained(self) -> bool:
        """model.pretrained's patch embedding gets this run's new input channels (cond.feed=concat or
        cond.control on a T2V checkpoint: widen_patch_embedding); LoRA then trains it beside the
        adapters (models/lora.py). False without pretrained weights or when its config cannot be read
        (read_pretrained's own check names why)."""
        if not self.pretrained:
            return False
        try:
            theirs = json.loads((pretrained_folder(self.pretrained, self) / "config.json").read_text())["in_channels"]
            return self.diffusers_kwargs()["in_channels"] > self.in_channels == theirs
        except (OSError, ValueError, KeyError):
            return False

# Wan's time embedding was trained on scheduler timesteps t·num_train_timesteps.
NUM_TRAIN_TIMESTEPS = 1000.0
# Key of our config for each WanTransformer3DModel config key (for clear mismatch errors).
_OUR_KEY = {"patch_size": "patch_size", "num_attention_heads": "heads", "attention_head_dim": "dim / heads",
            "in_channels": "in_channels + cond_channels (cond.feed=concat)", "out_channels": "in_channels", "text_dim": "text_dim",
            "freq_dim": "freq_dim", "ffn_dim": "ffn_dim", "num_layers": "depth",
            "cross_attn_norm": "cross_attn_norm", "eps": "norm_eps", "image_dim": "image_dim",
            "added_kv_proj_dim": "dim (with model.image_dim)", "pos_embed_seq_len": "pos_embed_seq_len",
            "vace_layers": "vace_layers", "vace_in_channels": "2 in_channels + vace_mask_channels (cond.control)"}


def wan_config(cfg: WanConfig) -> dict[str, Any]:
    """WanTransformer3DModel(**kwargs) of the same shape as `cfg` (model.name=wan)."""
    if cfg.dim % cfg.heads:
        raise ValueError(f"model.dim={cfg.dim} must be divisible by model.heads={cfg.heads}")
    if cfg.text_dim <= 0:
        raise ValueError("model.name=wan needs model.text_dim > 0 (width of the caption embeddings; 4096 for umT5)")
    if len(cfg.patch_size) != 3:
        raise ValueError(f"model.patch_size={list(cfg.patch_size)} must be [t, h, w]")
    if cfg.rope_theta != 10000.0:
        raise ValueError(f"model.rope_theta={cfg.rope_theta}: Wan's RoPE is fixed at 10000; remove the override")
    if cfg.pos_embed_seq_len and not cfg.image_dim:
        raise ValueError(f"model.pos_embed_seq_len={cfg.pos_embed_seq_len} positions image tokens: it needs model.image_dim > 0")
    # the concat conditioning widens the input only (Wan 2.1 I2V: 36 = 16 noisy + 4 mask + 16 image latents)
    return dict(patch_size=tuple(cfg.patch_size), num_attention_heads=cfg.heads, attention_head_dim=cfg.dim // cfg.heads,
                in_channels=cfg.in_channels + cfg.cond_channels, out_channels=cfg.in_channels, text_dim=cfg.text_dim,
                freq_dim=cfg.freq_dim, ffn_dim=cfg.ffn_dim or int(cfg.dim * cfg.mlp_ratio), num_layers=cfg.depth,
                cross_attn_norm=cfg.cross_attn_norm, eps=cfg.norm_eps,
                # the image branch's K/V read the embedded image tokens, of width dim (Wan 2.1 I2V)
                image_dim=cfg.image_dim or None, added_kv_proj_dim=cfg.dim if cfg.image_dim else None,
                pos_embed_seq_len=cfg.pos_embed_seq_len or None)


def wan_rope(pos: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (cos, sin) [L, head_dim/2] of WanRotaryPosEmbed for positions [L, 3] (t, h, w).

    Same split (h and w get 2·(head_dim//6) channels each, t the rest, in that order t|h|w) and
    the same float64 angles as diffusers' table, so the values are bit-identical to its lookup.
    """
    h_dim = w_dim = 2 * (head_dim // 6)
    parts = []
    for axis, d in enumerate((head_dim - h_dim - w_dim, h_dim, w_dim)):
        freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos.device) / d)
        parts.append(pos[:, axis, None].to(torch.float64) * freqs)
    ang = torch.cat(parts, dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_wan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [L, H, D] by angles cos/sin [L, D/2]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None], sin[:, None]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


class PackedRope:
    """What WanTransformerBlock passes untouched to attn1 as `rotary_emb`: the per-token
    rotation and the attention metadata. A plain class, not a dataclass, so FSDP's input cast
    leaves the fp32 angles alone (diffusers keeps RoPE in fp32 too)."""

    __slots__ = ("cos", "sin", "meta")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, meta: Any):
        self.cos, self.sin, self.meta = cos, sin, meta


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


class PackedContext:
    """What WanTransformerBlock passes untouched to attn2 as `encoder_hidden_states`.

    states: [S, Lc, dim] embedded captions; seg: [L] clip of each (local) token, -1 padding;
    lengths: [S] int64 caption tokens each clip attends to; image: [S, Li, dim] embedded image
    tokens of each clip (Wan 2.1 I2V's CLIP branch), or None.
    """

    __slots__ = ("states", "seg", "lengths", "image")

    def __init__(self, states: torch.Tensor, seg: torch.Tensor, lengths: torch.Tensor, image: torch.Tensor | None = None):
        self.states, self.seg, self.lengths, self.image = states, seg, lengths, image


class PackedWanAttnProcessor:
    """WanAttention processor for packed sequences (hidden_states [1, L, dim], batch of one; or
    [L, 1, dim], the L tokens as batches of one, as Wan VACE's blocks get them: models/wan_vace.py).

    Self-attention (encoder_hidden_states None): QK-RMSNorm, RoPE, `attn.attention_fn(q, k, v,
    meta)` with [L, H, D]. Cross-attention: each token attends to its own clip's caption, and
    with the image branch (attn.add_k_proj, Wan 2.1 I2V) also to its own clip's image tokens, the
    two outputs summed. Same projections and norms as diffusers' WanAttnProcessor.
    """

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: PackedContext | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: PackedRope | None = None) -> torch.Tensor:
        x = hidden_states.flatten(0, 1)
        if encoder_hidden_states is None:
            q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        else:
            ctx = encoder_hidden_states.states
            q, k, v = attn.to_q(x), attn.to_k(ctx), attn.to_v(ctx)
        q = attn.norm_q(q).unflatten(-1, (attn.heads, -1))
        k = attn.norm_k(k).unflatten(-1, (attn.heads, -1))
        v = v.unflatten(-1, (attn.heads, -1))
        if encoder_hidden_states is None:
            q = apply_wan_rope(q, rotary_emb.cos, rotary_emb.sin)
            k = apply_wan_rope(k, rotary_emb.cos, rotary_emb.sin)
            out = attn.attention_fn(q, k, v, rotary_emb.meta)
        else:
            out = packed_cross_attention(q, k, v, encoder_hidden_states.seg, encoder_hidden_states.lengths)
            if attn.add_k_proj is not None:
                out = out.flatten(1).type_as(q) + self._image_attention(attn, q, encoder_hidden_states)
        out = attn.to_out[1](attn.to_out[0](out.flatten(1).type_as(q)))
        return out.reshape(*hidden_states.shape[:-1], -1)

    @staticmethod
    def _image_attention(attn: nn.Module, q: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """[L, H·D]: each token's attention to its own clip's image tokens (diffusers' I2V branch)."""
        img = ctx.image
        k = attn.norm_added_k(attn.add_k_proj(img)).unflatten(-1, (attn.heads, -1))
        v = attn.add_v_proj(img).unflatten(-1, (attn.heads, -1))
        lengths = torch.full((img.shape[0],), img.shape[1], dtype=torch.long, device=img.device)
        return packed_cross_attention(q, k, v, ctx.seg, lengths).flatten(1).type_as(q)


class PackedWan(nn.Module):
    """Packed-sequence forward over a diffusers WanTransformer3DModel's modules.

    forward(x, pos, seg, t, meta, context=None, context_len=None, clean=None):
      x:    [L, C_in·pt·ph·pw]  noisy patches (+ concat conditioning channels), features (c, pt, ph, pw)
      pos:  [L, 3]           (t, h, w) patch coordinates inside each clip
      seg:  [L]              clip of each token (-1 = padding)
      t:    [S]              flow time of each clip in [0, 1]
      meta: attention metadata for `attention_fn` (VarlenLayout, or CPAttnLayout under CP)
      context: [S, Lc, text_dim] caption embeddings (valid tokens first); None = one all-zero token
      context_len: [S] int64 valid caption tokens
      clean: [L] bool tokens given clean (cond.feed=timestep): their clip's embedding at t = 0
      image: [S, Li, image_dim] CLIP image tokens of each clip (model.image_dim > 0: required;
             Wan 2.1 I2V: 257, FLF2V: 2 x 257, the first image's then the last's)
    returns [L, C·pt·ph·pw], the predicted velocity.
    """

    # Wan zero-initialises its output head when trained from scratch.
    zero_init = ("proj_out",)
    output_head = "proj_out"  # LoRA on a base where it is all zero cannot learn (engine/sanity.py)

    def __init__(self, cfg: WanConfig, backend: str = "sdpa"):
        super().__init__()
        self.diffusers_config = cfg.diffusers_kwargs()
        self.text_len, self.pad_context = cfg.text_len, cfg.attend_padded_context
        self.adopt(cfg.diffusers_model()(**self.diffusers_config), backend)

    def adopt(self, wan: nn.Module, backend: str) -> None:
        """Hold the diffusers model's modules under the same names: our state dict is diffusers'
        (its RoPE table is a non-persistent buffer we do not need: frequencies are recomputed per
        token); their attention gets the packed processor."""
        self.patch_embedding = wan.patch_embedding
        self.condition_embedder = wan.condition_embedder
        self.blocks = wan.blocks
        self.norm_out = wan.norm_out
        self.proj_out = wan.proj_out
        self.scale_shift_table = wan.scale_shift_table
        packed_attention(self.blocks, backend)

    def _context(self, context: torch.Tensor | None, context_len: torch.Tensor | None, S: int,
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions [S, Lc', text_dim] and the tokens each clip attends to [S]."""
        context, context_len = caption_batch(context, context_len, S, self.diffusers_config["text_dim"], like)
        if not self.pad_context:
            return context, context_len
        Lc = context.shape[1]
        if Lc > self.text_len:
            raise ValueError(f"captions have {Lc} tokens but model.text_len={self.text_len}; raise model.text_len")
        # Wan's convention: valid tokens, then zeros up to text_len, all attended to
        valid = torch.arange(Lc, device=context.device)[None, :] < context_len[:, None]
        context = F.pad(context * valid[..., None].to(context.dtype), (0, 0, 0, self.text_len - Lc))
        return context, torch.full_like(context_len, self.text_len)

    def _image(self, image: torch.Tensor | None, S: int) -> torch.Tensor | None:
        """The image tokens [S, Li, image_dim] as the image embedder takes them (None without
        the image branch); FLF2V's learnt positions span both images: [2S, Li/2, image_dim]."""
        image_dim = self.diffusers_config["image_dim"]
        if image_dim is None:
            return None
        if image is None or image.shape[0] != S or image.shape[-1] != image_dim:
            got = "none" if image is None else tuple(image.shape)
            raise ValueError(f"model.image_dim={image_dim}: the model needs each clip's CLIP image tokens "
                             f"[{S}, Li, {image_dim}], got {got} (cache them with tools.cache_latents --image-encoder)")
        image = image.to(self.condition_embedder.image_embedder.ff.net[0].proj.weight.dtype)
        if self.diffusers_config["pos_embed_seq_len"]:
            image = image.reshape(2 * S, image.shape[1] // 2, image_dim)
        return image

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                context: torch.Tensor | None = None, context_len: torch.Tensor | None = None,
                clean: torch.Tensor | None = None, image: torch.Tensor | None = None) -> torch.Tensor:
        S = t.shape[0]
        if clean is None:
            row = torch.where(seg < 0, torch.full_like(seg, S), seg)  # padding tokens use an extra time row (t=0)
            timestep = torch.cat([t.float(), t.new_zeros(1, dtype=torch.float32)]) * NUM_TRAIN_TIMESTEPS
        else:  # rows S..2S-1: each clip at t = 0, read by its clean context tokens; 2S: padding
            row = torch.where(seg < 0, torch.full_like(seg, 2 * S), seg + S * clean.to(seg.dtype))
            timestep = torch.cat([t.float(), t.new_zeros(S + 1, dtype=torch.float32)]) * NUM_TRAIN_TIMESTEPS
        context, lengths = self._context(context, context_len, S, x)
        context = context.to(self.condition_embedder.text_embedder.linear_1.weight.dtype)
        temb, timestep_proj, states, image = self.condition_embedder(timestep, context, self._image(image, S))  # [R, dim], [R, 6·dim]
        h = self.embed(x)  # [1, L, dim]
        temb_tok = timestep_proj.unflatten(1, (6, -1))[row][None]  # [1, L, 6, dim]
        rope = PackedRope(*wan_rope(pos, self.diffusers_config["attention_head_dim"]), meta)
        h = self.run_blocks(h, x, PackedContext(states, seg, lengths, image), temb_tok, rope)
        shift, scale = (self.scale_shift_table + temb[:, None]).unbind(1)  # [R, dim] each
        h = h[0]
        h = (self.norm_out(h.float()) * (1 + scale[row]) + shift[row]).type_as(h)
        out = self.proj_out(h)  # [L, (pt, ph, pw, c)]
        C = self.diffusers_config["out_channels"]
        return out.unflatten(-1, (-1, C)).transpose(1, 2).flatten(1)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """[1, L, dim]: the patch embedding of the input tokens x [L, C_in·pt·ph·pw]."""
        w = self.patch_embedding.weight  # inputs arrive in fp32 under FSDP2 mixed precision
        return F.linear(x.to(w.dtype), w.flatten(1), self.patch_embedding.bias)[None]

    def run_blocks(self, h: torch.Tensor, x: torch.Tensor, ctx: PackedContext, temb_tok: torch.Tensor,
                   rope: PackedRope) -> torch.Tensor:
        """The blocks over h [1, L, dim] (x: the input tokens, for models that read more of them)."""
        for block in self.blocks:
            h = block(h, ctx, temb_tok, rope)
        return h


def packed_attention(blocks: nn.ModuleList, backend: str) -> None:
    """Give the blocks' attention the packed processor and a swappable self-attention."""
    for block in blocks:
        block.attn1.set_processor(PackedWanAttnProcessor())
        block.attn2.set_processor(PackedWanAttnProcessor())
        block.attn1.attention_fn = LocalAttention(backend)  # swapped for CP by parallelize()


# --------------------------------------------------------------------------- diffusers folders


def build_wan(cfg: WanConfig, backend: str = "sdpa") -> nn.Module:
    """PackedWan, or for model.expert=both an ExpertPair of two (models/wan_experts.py)."""
    if cfg.expert == BOTH:
        return ExpertPair(PackedWan(cfg, backend), PackedWan(cfg, backend), cfg.boundary_ratio)
    return PackedWan(cfg, backend)


def read_pretrained(path: str, cfg: WanConfig) -> dict[str, torch.Tensor]:
    """fp32 CPU state dict of the diffusers folder `path` (WanTransformer3DModel), after
    checking its shape against `cfg` (error names the keys to set). model.expert=both: both
    experts' subfolders of a pipeline folder, under the prefixes transformer. / transformer_2."""
    if cfg.expert == BOTH:
        pretrained_folder(path, cfg)  # refuses a single transformer folder and another boundary
        return {f"{sub}.{k}": v for expert, sub in SUBFOLDER.items()
                for k, v in read_pretrained(path, dataclasses.replace(cfg, expert=expert)).items()}

    folder = pretrained_folder(path, cfg)  # a whole pipeline folder: its transformer (or an A14B expert's)
    try:
        wan = cfg.diffusers_model().from_pretrained(str(folder), torch_dtype=torch.float32,
                                                    use_safetensors=not cfg.allow_pickle_weights)
    except EnvironmentError as err:
        raise ValueError(f"model.pretrained={path}: {err} (weights must be .safetensors; "
                         f"model.allow_pickle_weights=true also reads .bin from a source you trust)") from None
    want = cfg.diffusers_kwargs()
    # a text-to-video checkpoint fine-tuned into concat conditioning (Wan 2.1 I2V style): its
    # patch embedding gets the new input channels, zero-initialised (widen_patch_embedding)
    extra = want["in_channels"] - cfg.in_channels
    widen = extra > 0 and wan.config["in_channels"] == cfg.in_channels
    if widen:
        want["in_channels"] = cfg.in_channels
    wrong = []
    for key, ours in want.items():
        theirs = wan.config[key]
        if _plain(theirs) != _plain(ours):
            wrong.append(f"{key}={theirs} (model.{_OUR_KEY[key]} gives {ours})")
    if (wan.config.get("image_dim") is None) != (want["image_dim"] is None):
        wrong.append("an image-to-video checkpoint (CLIP image branch) needs an I2V config: model=wan_i2v_14b "
                     "(or model.image_dim=1280 with cond.kind=first_frame cond.feed=concat model.mask_channels=4)"
                     if want["image_dim"] is None else
                     "a checkpoint without the CLIP image branch cannot start one (it would be untrained): set "
                     "model.image_dim=0 (a T2V checkpoint widens into cond.feed=concat without it)")
    if wrong:
        raise ValueError(f"model.pretrained={path} does not match the model config: " + "; ".join(wrong))
    state = {k: v.detach().float().contiguous() for k, v in wan.state_dict().items()}
    return widen_patch_embedding(state, extra) if widen else state


def _plain(value: Any) -> Any:
    """A config value as compared: lists (JSON's) as tuples."""
    return tuple(value) if isinstance(value, list) else value


def widen_patch_embedding(state: dict[str, torch.Tensor], extra: int) -> dict[str, torch.Tensor]:
    """A T2V state dict for a model whose patch embedding reads `extra` more input channels
    (cond.feed=concat: mask and conditioning frames, after the noisy ones): the new channels'
    weights start at zero, so the widened model computes exactly what the T2V one did until
    training teaches it to read them (as diffusers-based I2V fine-tuning scripts do)."""
    w = state["patch_embedding.weight"]  # [dim, C, pt, ph, pw]
    log.info("model.pretrained: the patch embedding gets %d zero-initialised input channels (cond.feed=concat)", extra)
    return state | {"patch_embedding.weight": torch.cat([w, w.new_zeros(w.shape[0], extra, *w.shape[2:])], dim=1)}


def to_diffusers(state_dict: dict[str, torch.Tensor], cfg: WanConfig) -> Any:
    """A diffusers WanTransformer3DModel (cfg.diffusers_model()) holding `state_dict` (our keys = diffusers' keys)."""
    wan = cfg.diffusers_model()(**cfg.diffusers_kwargs())
    wan.load_state_dict(state_dict, strict=True)
    return wan


def _checks(cfg: WanConfig) -> list[str]:
    errors = expert_checks(cfg)
    if len(cfg.vae_stride) != 3 or min(cfg.vae_stride) < 1:
        errors.append(f"model.vae_stride={list(cfg.vae_stride)} must be 3 positive ints [t, h, w] (the VAE's compression)")
    try:
        cfg.diffusers_kwargs()
    except ValueError as err:
        errors.append(str(err))
    if cfg.pretrained and Path(cfg.pretrained).expanduser().is_dir():
        try:  # its config.json (the transformer's, or an A14B expert's) before any worker loads weights
            pretrained_folder(cfg.pretrained, cfg)
        except (FileNotFoundError, ValueError) as err:
            errors.append(str(err))
    return errors


def _ffn(cfg: WanConfig) -> int:
    return cfg.ffn_dim or int(cfg.dim * cfg.mlp_ratio)


def _block_linears(b: nn.Module) -> list[nn.Module]:
    """Matmuls a block applies to every video token (attn2's to_k/to_v act on caption tokens only)."""
    return [b.attn1.to_q, b.attn1.to_k, b.attn1.to_v, b.attn1.to_out[0], b.attn2.to_q, b.attn2.to_out[0],
            b.ffn.net[0].proj, b.ffn.net[2]]


register_model(ModelSpec(
    name="wan", config=WanConfig, mode=Mode.video, build=build_wan, blocks=expert_blocks,
    checks=_checks,
    # measured with saved_tensors_hooks on diffusers' WanTransformerBlock run by PackedWan at
    # d = 64 and 128 (tests/test_planner.py re-measures every registered model): its FP32LayerNorms
    # and `.float()` residual/modulation keep ~16·d in fp32 under autocast
    activations=lambda cfg: ActivationModel(fp32_d=32.4, autocast_f32_d=16, autocast_lp_d=20.5, outside_d=6,
                                            selective_d=10.5),
    block_linears=_block_linears,
    # model.expert=both runs both experts on every token (models/wan_experts.py): twice the matmuls
    io_linears=lambda m: [lin for e in experts_of(m) for lin in (e.patch_embedding, e.proj_out)],
    io_dim=lambda cfg: (cfg.in_channels + cfg.cond_channels) * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2],
    hidden=_ffn,
    pretrained=lambda cfg: read_pretrained(cfg.pretrained, cfg), to_diffusers=to_diffusers,
    components=components,
))
