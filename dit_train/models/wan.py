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

from dataclasses import dataclass, field
from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.config.choices import Mode
from dit_train.config.schema import VideoModelConfig
from dit_train.kernels import packed_cross_attention
from dit_train.models.diffusers_family import DiffusersFamily
from dit_train.models.family_forward import (caption_batch, cross_attention_linears, PackedContext, packed_processors,
                                             PackedRope, take_modules, time_rows)
from dit_train.models.lora_formats import KeyMap
from dit_train.models.registry import ActivationModel, model_spec, ModelSpec, register_model
from dit_train.models.wan_experts import (BOTH, components, expert_blocks, expert_checks, expert_folders, ExpertPair,
                                         experts_of, sampling_boundary, timestep_range)


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


# Key of our config for each WanTransformer3DModel config key (for clear mismatch errors).
_OUR_KEY = {"patch_size": "patch_size", "num_attention_heads": "heads", "attention_head_dim": "dim / heads",
            "in_channels": "in_channels + cond_channels (cond.feed=concat)", "out_channels": "in_channels", "text_dim": "text_dim",
            "freq_dim": "freq_dim", "ffn_dim": "ffn_dim", "num_layers": "depth",
            "cross_attn_norm": "cross_attn_norm", "eps": "norm_eps", "image_dim": "image_dim",
            "added_kv_proj_dim": "dim (with model.image_dim)", "pos_embed_seq_len": "pos_embed_seq_len"}


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


def _image_branch(theirs: dict, want: dict) -> list[str]:
    """DiffusersFamily.notes: a folder with Wan 2.1 I2V's CLIP image branch for a config without it, or the reverse."""
    if (theirs.get("image_dim") is None) == (want["image_dim"] is None):
        return []
    if want["image_dim"] is None:
        return ["an image-to-video checkpoint (CLIP image branch) needs an I2V config: model=wan_i2v_14b "
                "(or model.image_dim=1280 with cond.kind=first_frame cond.feed=concat model.mask_channels=4)"]
    return ["a checkpoint without the CLIP image branch cannot start one (it would be untrained): set "
            "model.image_dim=0 (a T2V checkpoint widens into cond.feed=concat without it)"]


# Wan's LoRA names in its original checkpoint (ComfyUI's WanModel, musubi-tuner's files): diffusers'
# own Wan LoRA readers read the other way (diffusers.loaders.lora_conversion_utils:
# _convert_non_diffusers_wan_lora_to_diffusers, _convert_musubi_wan_lora_to_diffusers)
WAN_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v", "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
WAN_LORA_KEYS = KeyMap("Wan", blocks={"blocks": ("blocks", WAN_BLOCK)},
                       top={"condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head"},
                       unmapped="mapped: the blocks' attention and FFN linears, time_proj, proj_out")

WAN = DiffusersFamily(
    class_name="WanTransformer3DModel", kwargs=wan_config, our_keys=_OUR_KEY, folder_kind="a Wan folder",
    folders=expert_folders, notes=_image_branch, lora_keys=WAN_LORA_KEYS,
    # a text-to-video checkpoint fine-tuned into concat conditioning (Wan 2.1 I2V style): its patch
    # embedding gets the new input channels, zero-initialised
    widen_key="patch_embedding.weight")


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

    forward(x [L, C_in·pt·ph·pw], pos [L, 3], seg [L], t [S], meta, context [S, Lc, text_dim] = None,
    context_len [S] = None, clean [L] = None, image=None) -> [L, C·pt·ph·pw], the predicted velocity:
    the packed forward of models/family_forward.py (what each argument holds is said there), and
      image: [S, Li, image_dim] CLIP image tokens of each clip (model.image_dim > 0: required;
             Wan 2.1 I2V: 257, FLF2V: 2 x 257, the first image's then the last's)
    """

    # Wan zero-initialises its output head when trained from scratch.
    zero_init = ("proj_out",)
    output_head = "proj_out"  # LoRA on a base where it is all zero cannot learn (engine/sanity.py)
    family = WAN  # the diffusers class whose modules it holds (Wan VACE: its own)

    def __init__(self, cfg: WanConfig, backend: str = "sdpa"):
        super().__init__()
        self.diffusers_config = self.family.kwargs(cfg)
        self.text_len, self.pad_context = cfg.text_len, cfg.attend_padded_context
        self.adopt(self.family.model_class()(**self.diffusers_config), backend)

    def adopt(self, wan: nn.Module, backend: str) -> None:
        """Hold the diffusers model's modules under the same names: our state dict is diffusers'
        (its RoPE table is a non-persistent buffer we do not need: frequencies are recomputed per
        token); their attention gets the packed processor."""
        take_modules(self, wan, ("patch_embedding", "condition_embedder", "blocks", "norm_out", "proj_out",
                                 "scale_shift_table"))
        packed_processors(self.blocks, PackedWanAttnProcessor, backend)

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

    @staticmethod
    def _rows(t: torch.Tensor, seg: torch.Tensor, clean: torch.Tensor | None,
              block: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row [L], timestep [R]): one flow time per clip (family_forward.time_rows); Wan has no
        per-block times, so `block` plays no part (SkyReels-V2 overrides this)."""
        return time_rows(t, seg, clean)

    def _modulation(self, proj: torch.Tensor) -> torch.Tensor:
        """The blocks' modulation rows [R, 6·dim] as the condition embedder gives them (SkyReels-V2
        adds its fps embedding here)."""
        return proj

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                context: torch.Tensor | None = None, context_len: torch.Tensor | None = None,
                clean: torch.Tensor | None = None, image: torch.Tensor | None = None,
                block: torch.Tensor | None = None) -> torch.Tensor:
        S = t.shape[0]
        row, timestep = self._rows(t, seg, clean, block)  # [L], [R]
        context, lengths = self._context(context, context_len, S, x)
        context = context.to(self.condition_embedder.text_embedder.linear_1.weight.dtype)
        temb, timestep_proj, states, image = self.condition_embedder(timestep, context, self._image(image, S))  # [R, dim], [R, 6·dim]
        timestep_proj = self._modulation(timestep_proj)
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


# --------------------------------------------------------------------------- the family


def build_wan(cfg: WanConfig, backend: str = "sdpa") -> nn.Module:
    """PackedWan, or for model.expert=both an ExpertPair of two (models/wan_experts.py)."""
    if cfg.expert == BOTH:
        return ExpertPair(PackedWan(cfg, backend), PackedWan(cfg, backend), cfg.boundary_ratio)
    return PackedWan(cfg, backend)


def _checks(cfg: WanConfig) -> list[str]:
    """Wan's own checks, before the family's (shape, then model.pretrained's config.json)."""
    errors = expert_checks(cfg)
    if len(cfg.vae_stride) != 3 or min(cfg.vae_stride) < 1:
        errors.append(f"model.vae_stride={list(cfg.vae_stride)} must be 3 positive ints [t, h, w] (the VAE's compression)")
    return errors


def block_linears(b: nn.Module) -> list[nn.Module]:
    """ModelSpec.block_linears of a Wan block (models/family_forward.cross_attention_linears)."""
    return cross_attention_linears(b, b.ffn)


def wan_spec(family: DiffusersFamily, **fields: Any) -> ModelSpec:
    """The ModelSpec of a Wan-architecture family (`fields`: what differs: name, config, build, blocks...)."""
    return family.spec(
        checks=_checks, mode=Mode.video,
        # measured with saved_tensors_hooks on diffusers' WanTransformerBlock run by PackedWan at
        # d = 64 and 128 (tests/test_planner.py re-measures every registered model): its FP32LayerNorms
        # and `.float()` residual/modulation keep ~16·d in fp32 under autocast
        activations=lambda cfg: ActivationModel(fp32_d=32.4, autocast_f32_d=16, autocast_lp_d=20.5, outside_d=6,
                                                selective_d=10.5),
        io_dim=lambda cfg: (cfg.in_channels + cfg.cond_channels) * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2],
        hidden=lambda cfg: cfg.ffn_dim or int(cfg.dim * cfg.mlp_ratio),
        # self- and cross-attention q/k/v/out and both FFN projections of every block, the set
        # DiffSynth-Studio trains for Wan ("q,k,v,o,ffn.0,ffn.2" in Wan's original names);
        # finetrainers' Wan examples adapt attention only (model.lora.targets=[to_q,to_k,to_v,to_out.0])
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
        **fields)


register_model(wan_spec(
    WAN, name="wan", config=WanConfig, build=build_wan, blocks=expert_blocks, block_linears=block_linears,
    # model.expert=both runs both experts on every token (models/wan_experts.py): twice the matmuls
    io_linears=lambda m: [lin for e in experts_of(m) for lin in (e.patch_embedding, e.proj_out)],
    components=components,
))
