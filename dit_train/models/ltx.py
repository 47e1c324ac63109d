"""diffusers' LTXVideoTransformer3DModel (LTX-Video) trained through our packed path.

`PackedLTX` holds the very submodules of a diffusers `LTXVideoTransformer3DModel` under the
same names (proj_in, scale_shift_table, time_embed, caption_projection,
transformer_blocks.N.*, norm_out, proj_out), so its state dict IS a diffusers state dict:
pretrained folders load 1:1 and trained weights export back with `save_pretrained`. Only the
forward is ours, so that several clips of different sizes share one flat token sequence and
every parallelism of dit_train (FSDP2 over `.transformer_blocks`, Ulysses/ring CP through
`attention_fn`) applies unchanged:

- input: LTX's own tokens are patches with features (c, pt, ph, pw) (LTXPipeline._pack_latents),
  exactly our patch features, so `proj_in` reads them as they are; the output comes back in
  the same order;
- time: one embedding per clip (AdaLayerNormSingle of timestep = 1000·t, noise at t = 1 as
  ours and LTXPipeline's FlowMatchEulerDiscreteScheduler), gathered per token: the per-token
  timestep path LTX 0.9.5+ uses for its conditioning frames; clean context tokens of
  cond.feed=timestep read their clip's embedding at t = 0;
- 3-D RoPE: LTXVideoRotaryPosEmbed's frequencies over the whole width (not per head),
  computed from each token's (t, h, w) scaled by `model.rope_scale` (LTXPipeline's
  rope_interpolation_scale: VAE compression / frame rate, 32, 32), so a token's rotation
  depends only on its own position: under Ulysses or ring CP each rank rotates its local
  tokens and the split needs nothing more;
- attention: each block's LTXAttention gets `PackedLTXAttnProcessor`: self-attention calls
  `attn1.attention_fn` (varlen inside each clip; swapped for CP by parallelize),
  cross-attention attends each token to the valid tokens of its own clip's caption (LTX masks
  the T5 padding, `encoder_attention_mask`) with `dit_train.kernels.packed_cross_attention`.

No parallelism here (no torch.distributed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List

import torch
from torch import nn

from dit_train.config.choices import Mode
from dit_train.config.schema import VideoModelConfig
from dit_train.kernels import packed_cross_attention
from dit_train.models.diffusers_family import DiffusersFamily
from dit_train.models.family_forward import (caption_batch, cross_attention_linears, PackedContext, packed_processors,
                                             PackedRope, take_modules, time_rows)
from dit_train.models.lora_formats import KeyMap
from dit_train.models.registry import ActivationModel, register_model
from dit_train.objectives.flow_matching import PipelineShift

# LTXVideoRotaryPosEmbed's normalisation of coordinates (fixed in LTXVideoTransformer3DModel)
ROPE_BASE = (20.0, 2048.0, 2048.0)


@dataclass
class LTXConfig(VideoModelConfig):
    """diffusers' LTXVideoTransformer3DModel through the packed path (`model.name=ltx`)."""

    name: str = "ltx"
    # Local diffusers folder (config.json + safetensors of an LTXVideoTransformer3DModel, or a
    # pipeline folder holding transformer/) to start from; "" = initialise from train.seed.
    pretrained: str = ""
    norm_eps: float = 1e-6
    # LTXPipeline's rope_interpolation_scale (t, h, w): VAE temporal compression / frame rate,
    # then the spatial compression twice (8/25, 32, 32 for LTX-Video at 25 fps); RoPE sees the
    # patch coordinates times this times the patch size, over (20, 2048, 2048)
    rope_scale: List[float] = field(default_factory=lambda: [0.32, 32.0, 32.0])
    # model.pretrained must hold safetensors weights (a pickle can run code on load); true also
    # accepts .bin/.pt weights from a source you trust
    allow_pickle_weights: bool = False
    # sampling (validation, tools.sample) with LTXPipeline's schedule instead of loss.timestep_shift:
    # shift e^mu, mu linear in the clip's token count from base_shift at base_seq_len to max_shift
    # at max_seq_len, the sigmas stretched to end at shift_terminal (LTX-Video's scheduler_config.json)
    pipeline_shift: bool = False
    base_shift: float = 0.95
    max_shift: float = 2.05
    base_seq_len: int = 1024
    max_seq_len: int = 4096
    shift_terminal: float = 0.1

    def pipeline_schedule(self) -> PipelineShift | None:
        """LTXPipeline's token-count schedule when model.pipeline_shift, else None."""
        if not self.pipeline_shift:
            return None
        return PipelineShift(self.base_shift, self.max_shift, self.base_seq_len, self.max_seq_len, self.shift_terminal)


# Key of our config for each LTXVideoTransformer3DModel config key (for clear mismatch errors).
_OUR_KEY = {"in_channels": "(in_channels + cond_channels) x patch volume", "out_channels": "in_channels x patch volume",
            "patch_size": "patch_size[1] (= patch_size[2])", "patch_size_t": "patch_size[0]",
            "num_attention_heads": "heads", "attention_head_dim": "dim / heads", "cross_attention_dim": "dim",
            "num_layers": "depth", "caption_channels": "text_dim", "norm_eps": "norm_eps"}
# LTXVideoTransformer3DModel keys our packed forward assumes (a folder with others is refused)
_FIXED = {"activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False,
          "attention_bias": True, "attention_out_bias": True}


def ltx_config(cfg: LTXConfig) -> dict[str, Any]:
    """LTXVideoTransformer3DModel(**kwargs) of the same shape as `cfg` (model.name=ltx)."""
    if cfg.dim % cfg.heads:
        raise ValueError(f"model.dim={cfg.dim} must be divisible by model.heads={cfg.heads}")
    if cfg.text_dim <= 0:
        raise ValueError("model.name=ltx needs model.text_dim > 0 (width of the caption embeddings; 4096 for T5-XXL)")
    if len(cfg.patch_size) != 3 or cfg.patch_size[1] != cfg.patch_size[2]:
        raise ValueError(f"model.patch_size={list(cfg.patch_size)} must be [t, p, p] (LTX patches are square)")
    if cfg.rope_theta != 10000.0:
        raise ValueError(f"model.rope_theta={cfg.rope_theta}: LTX's RoPE is fixed at 10000; remove the override")
    if cfg.mlp_ratio != 4.0:
        raise ValueError(f"model.mlp_ratio={cfg.mlp_ratio}: LTX's feed-forward is 4 x dim; remove the override")
    if len(cfg.rope_scale) != 3:
        raise ValueError(f"model.rope_scale={list(cfg.rope_scale)} must be [t, h, w]")
    vol = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    return dict(in_channels=(cfg.in_channels + cfg.cond_channels) * vol, out_channels=cfg.in_channels * vol,
                patch_size=cfg.patch_size[1], patch_size_t=cfg.patch_size[0], num_attention_heads=cfg.heads,
                attention_head_dim=cfg.dim // cfg.heads, cross_attention_dim=cfg.dim, num_layers=cfg.depth,
                caption_channels=cfg.text_dim, norm_eps=cfg.norm_eps)


# LTX-Video's LoRA names: inside the blocks the original checkpoint's are diffusers' (ComfyUI's
# comfy/ldm/lightricks/model.py LTXVModel: transformer_blocks.N.attn1.to_q, ff.net.0.proj, ...; diffusers'
# _convert_non_diffusers_ltxv_lora_to_diffusers only strips `diffusion_model.`), and so are proj_out and
# caption_projection.linear_1/2. That reader also drops `.alpha` (peft then takes alpha = r): alpha folded
LTX_LORA_KEYS = KeyMap("LTX-Video", blocks={"transformer_blocks": ("transformer_blocks", None)},
                       top={m: m for m in ("proj_out", "caption_projection.linear_1", "caption_projection.linear_2")},
                       alpha=False,
                       unmapped="ComfyUI names proj_in and time_embed patchify_proj and adaln_single, diffusers' "
                                "LTX-Video LoRA reader keeps their diffusers names: no name both read")

LTX = DiffusersFamily(class_name="LTXVideoTransformer3DModel", kwargs=ltx_config, our_keys=_OUR_KEY, fixed=_FIXED,
                      folder_kind="an LTX-Video folder", article="an", lora_keys=LTX_LORA_KEYS)


def ltx_rope(pos: torch.Tensor, dim: int, scale: tuple[float, float, float], patch: tuple[int, int, int],
             theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (cos, sin) [L, dim] of LTXVideoRotaryPosEmbed for patch positions [L, 3] (t, h, w).

    The same float32 ops in the same order as diffusers (coordinate · scale · patch / base,
    frequencies interleaved over the three axes, each repeated for a pair, the dim % 6 leftover
    channels unrotated at the front), so the values equal its table's bit for bit."""
    grid = torch.stack([pos[:, a].to(torch.float32) * scale[a] * patch[a] / ROPE_BASE[a] for a in range(3)], dim=-1)
    freqs = theta ** torch.linspace(math.log(1.0, theta), math.log(theta, theta), dim // 6, device=pos.device,
                                    dtype=torch.float32)
    freqs = freqs * math.pi / 2.0
    freqs = (freqs * (grid.unsqueeze(-1) * 2 - 1)).transpose(-1, -2).flatten(1)  # [L, 3·(dim//6)]
    cos, sin = freqs.cos().repeat_interleave(2, dim=-1), freqs.sin().repeat_interleave(2, dim=-1)
    if dim % 6:
        cos = torch.cat([torch.ones_like(cos[:, : dim % 6]), cos], dim=-1)
        sin = torch.cat([torch.zeros_like(sin[:, : dim % 6]), sin], dim=-1)
    return cos, sin


def apply_ltx_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' LTX apply_rotary_emb on x [L, dim] (pairs (x[2i], x[2i+1]), in fp32)."""
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class PackedLTXAttnProcessor:
    """LTXAttention processor for packed sequences (hidden_states [1, L, dim], batch of one).

    Self-attention (encoder_hidden_states None): RMSNorm across heads on q and k, RoPE over the
    width, `attn.attention_fn(q, k, v, meta)` with [L, H, D]. Cross-attention (a PackedContext):
    each token attends to its own clip's caption. Same projections and norms as diffusers'
    LTXVideoAttnProcessor."""

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: PackedContext | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: PackedRope | None = None) -> torch.Tensor:
        x = hidden_states[0]
        src = x if encoder_hidden_states is None else encoder_hidden_states.states
        q, k, v = attn.norm_q(attn.to_q(x)), attn.norm_k(attn.to_k(src)), attn.to_v(src)
        if encoder_hidden_states is None:
            q = apply_ltx_rope(q, image_rotary_emb.cos, image_rotary_emb.sin)
            k = apply_ltx_rope(k, image_rotary_emb.cos, image_rotary_emb.sin)
        q, k, v = (y.unflatten(-1, (attn.heads, -1)) for y in (q, k, v))
        if encoder_hidden_states is None:
            out = attn.attention_fn(q, k, v, image_rotary_emb.meta)
        else:
            out = packed_cross_attention(q, k, v, encoder_hidden_states.seg, encoder_hidden_states.lengths)
        out = attn.to_out[1](attn.to_out[0](out.flatten(1).to(q.dtype)))
        return out[None]


class PackedLTX(nn.Module):
    """Packed-sequence forward over a diffusers LTXVideoTransformer3DModel's modules.

    forward(x [L, C_in·pt·ph·pw], pos [L, 3], seg [L], t [S], meta, context [S, Lc, text_dim] = None,
    context_len [S] = None, clean [L] = None) -> [L, C·pt·ph·pw], the predicted velocity: the packed
    forward of models/family_forward.py (what each argument holds is said there).
    """

    # zero output head when trained from scratch (a random LTX has none: ours starts at rest,
    # like the DiT and Wan; a pretrained folder brings its own)
    zero_init = ("proj_out",)
    output_head = "proj_out"  # LoRA on a base where it is all zero cannot learn (engine/sanity.py)

    def __init__(self, cfg: LTXConfig, backend: str = "sdpa"):
        super().__init__()
        self.diffusers_config = ltx_config(cfg)
        self.patch, self.rope_scale = tuple(cfg.patch_size), tuple(float(s) for s in cfg.rope_scale)
        # the same modules under the same names: our state dict is diffusers' (its `rope`
        # holds no weights: the rotation is computed per token from positions)
        take_modules(self, LTX.model_class()(**self.diffusers_config),
                     ("proj_in", "scale_shift_table", "time_embed", "caption_projection", "transformer_blocks", "norm_out",
                      "proj_out"))
        packed_processors(self.transformer_blocks, PackedLTXAttnProcessor, backend)

    def _context(self, context: torch.Tensor | None, context_len: torch.Tensor | None, S: int,
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions [S, Lc, text_dim] and the valid tokens each clip attends to [S]."""
        return caption_batch(context, context_len, S, self.diffusers_config["caption_channels"], like)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                context: torch.Tensor | None = None, context_len: torch.Tensor | None = None,
                clean: torch.Tensor | None = None) -> torch.Tensor:
        S = t.shape[0]
        row, timestep = time_rows(t, seg, clean)  # [L], [R]
        w = self.proj_in.weight  # inputs arrive in fp32 under FSDP2 mixed precision
        h = self.proj_in(x.to(w.dtype))[None]  # [1, L, dim]
        temb, embedded = self.time_embed(timestep, batch_size=timestep.shape[0], hidden_dtype=h.dtype)  # [R, 6·dim], [R, dim]
        context, lengths = self._context(context, context_len, S, x)
        states = self.caption_projection(context.to(self.caption_projection.linear_1.weight.dtype))  # [S, Lc, dim]
        rope = PackedRope(*ltx_rope(pos, h.shape[-1], self.rope_scale, self.patch), meta)
        ctx = PackedContext(states, seg, lengths)
        temb_tok = temb[row][None]  # [1, L, 6·dim]
        for block in self.transformer_blocks:
            h = block(h, ctx, temb_tok, rope)
        shift, scale = (self.scale_shift_table[None] + embedded[:, None]).unbind(1)  # [R, dim] each
        h = self.norm_out(h[0]) * (1 + scale[row]) + shift[row]
        return self.proj_out(h)  # [L, (c, pt, ph, pw)], LTX's token features


# --------------------------------------------------------------------------- the family


def _checks(cfg: LTXConfig) -> list[str]:
    """LTX's own checks, before the family's (shape, then model.pretrained's config.json)."""
    if cfg.pipeline_shift and not (0 < cfg.base_seq_len < cfg.max_seq_len and 0 <= cfg.shift_terminal < 1):
        return [f"model.pipeline_shift needs 0 < model.base_seq_len < model.max_seq_len (got {cfg.base_seq_len}, "
                f"{cfg.max_seq_len}) and model.shift_terminal in [0, 1) (got {cfg.shift_terminal})"]
    return []


register_model(LTX.spec(
    name="ltx", config=LTXConfig, mode=Mode.video, build=lambda cfg, backend="sdpa": PackedLTX(cfg, backend),
    checks=_checks,
    # measured with saved_tensors_hooks on LTXVideoTransformerBlock run by PackedLTX at d = 64
    # and 128 (perf/memory.py calibrate_block: 31.3·d fp32; 2·16 + 19.4 = 51.4 bf16-equivalent
    # d-elements under autocast, both widths; tests/test_planner.py re-measures every registered
    # model); selective_d likewise (bytes_per_token_per_block with the selective policy: 10.2·d
    # in fp32, 11.3·d under bf16 autocast, at both widths)
    activations=lambda cfg: ActivationModel(fp32_d=31.3, autocast_f32_d=16, autocast_lp_d=19.4, outside_d=6,
                                            selective_d=10.5),
    blocks=lambda m: m.transformer_blocks,
    block_linears=lambda b: cross_attention_linears(b, b.ff),
    io_linears=lambda m: [m.proj_in, m.proj_out],
    io_dim=lambda cfg: (cfg.in_channels + cfg.cond_channels) * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2],
    hidden=lambda cfg: 4 * cfg.dim,
    # the attention (attn1/attn2 q/k/v/out) and feed-forward set of Wan's default, under LTX's names
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
    vae_stride=(8, 32, 32),  # LTX-Video's VAE: 8x in time (plus the first frame), 32x in height and width
))
