"""diffusers' MiniMaxH3Transformer3DModel (MiniMax-H3: text, audio and video in one sequence)
trained through our packed path.

MiniMax-H3 runs one stack of blocks over one sequence per sample holding its caption tokens, its
audio tokens and its video tokens, with full self-attention inside it (no cross-attention): a
modality tag per row (0 video, 1 text, 2 audio) picks the AdaLN row of the (timestep, modality)
table, two input projections and two output heads serve the media streams. In a pack that is
exactly a clip's attention segment: its video tokens, then its audio tokens (tasks/joint_audio.py,
`stream` 1) and its caption tokens as slots of the pack (tasks/joint_text.py, weight 0, `text`
[L]: 1 + the caption token), all with the clip's seg. So the pack's own layout is the model's
attention layout, and CP (Ulysses, ring) splits it like any pack.

`PackedMiniMaxH3` holds the diffusers model's modules under their names (state dict = diffusers');
each block is diffusers' own `MiniMaxH3TransformerBlock.forward`; only its attention processor
is ours (`attention_fn` over the pack's layout instead of one unmasked document). What we build
as the pipeline does (diffusers' modular_pipelines/minimax_h3/before_denoise.py):

- positions: a clip's text token j at (j, 0, 0), its audio token i at (Lt + i, 0, w_0), its
  video token (f, h, w) at (Lt + time(f), hgrid[h], wgrid[w]): Lt its caption tokens, time the
  pipeline's non-uniform 5/3·(1, 4, 4, 4, 4) frame clock, the aspect-normalised spatial grids
  (×32), w_0 the first width coordinate (one audio channel: mono);
- time: MiniMax's timestep is 1 − t (t = 1 clean), text rows take their clip's video timestep,
  tokens given clean t = 1;
- sign: MiniMax predicts the data-ward velocity x0 − ε; ours is ε − x0, so the heads' output is
  negated (a pretrained folder then trains under our objective unchanged).

The video grid of a clip (max + 1 of its positions) is read from the whole pack: under CP from
the layout, which keeps the full pack's positions (a rank may hold part of a clip). No
parallelism here (no torch.distributed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dit_train.config.choices import Mode
from dit_train.config.schema import VideoModelConfig
from dit_train.kernels import LocalAttention
from dit_train.models.diffusers_family import DiffusersFamily
from dit_train.models.family_forward import joint_attention_linears, PackedRope, take_modules
from dit_train.models.registry import ActivationModel, register_model

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2  # MiniMax-H3's modality tags (MINIMAX_H3_MODALITY_NUM = 3)
AUDIO = 1  # PackedBatch.stream of an audio token
# the pipeline's rotary frame clock: latent frame k spans 5/3 · _FRAMES[k % 5] (before_denoise.py)
_FRAME_RESCALE, _FRAMES, _SPATIAL_SCALE = 5.0 / 3.0, (1, 4, 4, 4, 4), 32.0


@dataclass
class MiniMaxH3Config(VideoModelConfig):
    """diffusers' MiniMaxH3Transformer3DModel through the packed path (`model.name=minimax_h3`)."""

    name: str = "minimax_h3"
    # Local diffusers folder (config.json + safetensors of a MiniMaxH3Transformer3DModel, or a
    # pipeline folder holding transformer/) to start from; "" = initialise from train.seed.
    pretrained: str = ""
    allow_pickle_weights: bool = False  # as model=ltx2: .bin/.pt weights only from a source you trust
    head_dim: int = 16  # attention_head_dim (MiniMax-H3's heads x head_dim exceeds its width)
    ffn_dim: int = 256  # SwiGLU inner width
    refiner_depth: int = 2  # token-refiner blocks run on each caption
    audio_patch: int = 640  # features of an audio token (audio_in_channels; 32 for MiniMax-H3's audio latents)
    freq_dim: int = 256  # sinusoidal timestep features
    time_hidden: int = 128  # timestep MLP's inner width (time_embed_hidden_dim)
    time_dim: int = 64  # timestep MLP's output, read by every AdaLN (time_embed_dim)
    rope_freq_dim: int = 2  # rotary frequencies per axis: 6·rope_freq_dim channels of a head rotate
    norm_eps: float = 1e-5


_OUR_KEY = {"num_attention_heads": "heads", "attention_head_dim": "head_dim", "hidden_size": "dim",
            "num_layers": "depth", "num_refiner_layers": "refiner_depth", "ffn_dim": "ffn_dim",
            "in_channels": "in_channels", "audio_in_channels": "audio_patch", "patch_size": "patch_size",
            "text_dim": "text_dim", "freq_dim": "freq_dim", "time_embed_hidden_dim": "time_hidden",
            "time_embed_dim": "time_dim", "rope_freq_dim": "rope_freq_dim", "rope_theta": "rope_theta",
            "norm_eps": "norm_eps", "qk_norm_eps": "norm_eps", "final_norm_eps": "norm_eps"}


def minimax_h3_config(cfg: MiniMaxH3Config) -> dict[str, Any]:
    """MiniMaxH3Transformer3DModel(**kwargs) of the same shape as `cfg` (ValueError naming the key)."""
    if cfg.text_dim <= 0:
        raise ValueError("model.name=minimax_h3 needs model.text_dim > 0 (width of the caption embeddings; 5120 for "
                         "MiniMax-H3's Qwen3-VL features)")
    if cfg.cond_channels:
        raise ValueError("model.name=minimax_h3: cond.feed=concat / cond.control widen the input, MiniMax-H3 has "
                         "none (its conditioning frames are tokens of the sequence)")
    if 6 * cfg.rope_freq_dim > cfg.head_dim or cfg.audio_patch <= 0 or len(cfg.patch_size) != 3:
        raise ValueError(f"model.rope_freq_dim={cfg.rope_freq_dim}: 6 x it must be <= model.head_dim={cfg.head_dim}; "
                         f"model.audio_patch={cfg.audio_patch} > 0; model.patch_size [t, h, w]")
    eps = float(cfg.norm_eps)
    return dict(num_attention_heads=cfg.heads, attention_head_dim=cfg.head_dim, hidden_size=cfg.dim,
                num_layers=cfg.depth, num_refiner_layers=cfg.refiner_depth, ffn_dim=cfg.ffn_dim,
                in_channels=cfg.in_channels, audio_in_channels=cfg.audio_patch,
                patch_size=tuple(int(p) for p in cfg.patch_size), text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
                time_embed_hidden_dim=cfg.time_hidden, time_embed_dim=cfg.time_dim,
                rope_freq_dim=cfg.rope_freq_dim, rope_theta=float(cfg.rope_theta), norm_eps=eps, qk_norm_eps=eps,
                final_norm_eps=eps)


def pipeline_notes(cfg: MiniMaxH3Config) -> list[str]:
    """Why an export of `cfg` loads (from_pretrained) but does not fit MiniMax-H3's modular pipeline:
    its layout counts latent frames, one row each, so only a temporal patch of 1 matches; [] then."""
    if cfg.patch_size[0] == 1:
        return []
    return [f"model.patch_size={list(cfg.patch_size)}: this folder loads with MiniMaxH3Transformer3DModel.from_pretrained "
            "but MiniMax-H3's pipeline lays out one row per latent frame (temporal patch 1, as MiniMax-H3's own)"]


MINIMAX_H3 = DiffusersFamily(class_name="MiniMaxH3Transformer3DModel", kwargs=minimax_h3_config, our_keys=_OUR_KEY,
                             folder_kind="a MiniMax-H3 folder", export_notes=pipeline_notes)

# the diffusers modules PackedMiniMaxH3 holds, in MiniMaxH3Transformer3DModel's order (= its state dict's)
# (not its `rope`: its frequencies are a non-persistent buffer, which a model built on the meta
# device and filled from a folder under FSDP2 would leave as garbage; `_rotation` makes them per call)
_MODULES = ("proj_in", "audio_proj_in", "context_embedder", "time_proj", "time_embedder", "token_refiner",
            "transformer_blocks", "norm_out", "proj_out", "audio_proj_out")


def _rotation(positions: torch.Tensor, freq_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' MiniMaxH3RotaryPosEmbed of positions [L, 3]: (cos, sin) [L, 6·freq_dim], from a fresh
    module (its inv_freq made here, on the positions' device)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed  # deferred: ~2 s import

    return MiniMaxH3RotaryPosEmbed(freq_dim, theta).to(positions.device)(positions)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' rotation of the leading channels of each head: x [L, H, D], cos / sin [L, r]."""
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb  # deferred: ~2 s import

    return _apply_rotary_emb(x[None], cos, sin)[0]


class PackedMiniMaxH3AttnProcessor:
    """MiniMaxH3Attention processor for a pack: hidden_states [1, L, dim], rotary_emb a PackedRope
    (cos, sin [L, r] and the pack's layout): q, k, v as diffusers computes them, attended with the
    layer's `attention_fn` (a clip's tokens see its tokens: text, audio and video alike)."""

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, rotary_emb: PackedRope | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = hidden_states[0]
        q = attn.norm_q(attn.to_q(h).unflatten(-1, (attn.heads, -1)))
        k = attn.norm_k(attn.to_k(h).unflatten(-1, (attn.heads, -1)))
        v = attn.to_v(h).unflatten(-1, (attn.heads, -1))
        q, k = _rotate(q, rotary_emb.cos, rotary_emb.sin), _rotate(k, rotary_emb.cos, rotary_emb.sin)
        out = attn.attention_fn(q, k, v, rotary_emb.meta).flatten(1).to(h.dtype)
        return attn.to_out[1](attn.to_out[0](out))[None]


def _spatial(n: torch.Tensor, ratio: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """The pipeline's aspect-normalised axis: coordinate of patch i of n, ratio = side / sqrt(area)."""
    return ((1.0 - ratio) / 2.0 + i * ratio / n) * _SPATIAL_SCALE


def clip_grids(pos: torch.Tensor, seg: torch.Tensor, S: int) -> torch.Tensor:
    """[S, 2] float64 each clip's patch grid (rows, cols): max + 1 of its tokens' (h, w) in the WHOLE
    pack (pos [L, 3], seg [L]; audio and caption tokens sit at h = w = 0 and change nothing)."""
    grid = torch.ones(S, 2, dtype=torch.float64, device=pos.device)
    real = seg >= 0
    if S and bool(real.any()):
        grid = grid.scatter_reduce(0, seg[real, None].expand(-1, 2), pos[real, 1:].double() + 1, "amax")
    return grid


def positions(pos: torch.Tensor, seg: torch.Tensor, tag: torch.Tensor, text: torch.Tensor, text_len: torch.Tensor,
              grid: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[L, 3] float64 MiniMax-H3 rotary coordinates of a pack's tokens (module docstring): pos [L, 3]
    our patch coordinates (an audio token's pos[:, 0] its index in its track), seg [L], tag [L]
    modality, text [L] 1 + caption index, text_len [S] each clip's caption tokens, grid [S, 2]
    `clip_grids` of the whole pack."""
    pos, out = pos.double(), pos.new_zeros(pos.shape, dtype=torch.float64)
    S = grid.shape[0]  # padding reads one more row (a rank's pack may hold no clip at all)
    seg_c = torch.where(seg >= 0, seg, S)
    grid = torch.cat([grid, grid.new_ones(1, 2)])
    text_len = torch.cat([text_len, text_len.new_zeros(1)])
    video = (tag == VIDEO_TAG) & (seg >= 0)
    hh, ww = grid[:, 0] * patch[1], grid[:, 1] * patch[2]
    area = torch.sqrt(hh * ww)
    rh, rw = (hh / area)[seg_c], (ww / area)[seg_c]
    lt = text_len.double()[seg_c]
    f = pos[:, 0]
    # frame clock: Σ_{k<f} 5/3·P[k % 5] for P = (1, 4, 4, 4, 4): ceil(f / 5) frames of 1, the rest 4
    ones = torch.div(f + 4, 5, rounding_mode="floor")
    clock = _FRAME_RESCALE * (ones + 4 * (f - ones))
    w0 = _spatial(grid[:, 1][seg_c], rw, torch.zeros_like(f))
    out[:, 0] = torch.where(tag == TEXT_TAG, (text - 1).double(), lt + torch.where(video, clock, f))
    out[:, 1] = torch.where(video, _spatial(grid[:, 0][seg_c], rh, pos[:, 1]), 0.0)
    out[:, 2] = torch.where(video, _spatial(grid[:, 1][seg_c], rw, pos[:, 2]), torch.where(tag == AUDIO_TAG, w0, 0.0))
    return torch.where((seg >= 0)[:, None], out, 0.0)


class PackedMiniMaxH3(nn.Module):
    """Packed-sequence forward over a diffusers MiniMaxH3Transformer3DModel's modules.

    forward(x [L, max(C·pt·ph·pw, audio_patch)], pos [L, 3], seg [L], t [S], meta,
    context [S, Lc, text_dim] = None, context_len [S] = None, clean [L] = None, stream [L] = None,
    text [L] = None) -> [L, width]: our velocity ε − x0 of every video token (first C·pt·ph·pw
    values) and audio token (first audio_patch), 0 on text slots and padding; width =
    max(C·pt·ph·pw, audio_patch) with `stream`, else C·pt·ph·pw. The arguments are
    models/family_forward.py's, `stream` PackedBatch.stream (1 = audio), `text` the caption slots
    (tasks/joint_text.py; None = none: clips attend without their caption).
    """

    zero_init = ("proj_out", "audio_proj_out")  # from scratch both heads start at rest
    output_head = "proj_out"  # LoRA on a base where it is all zero cannot learn (engine/sanity.py)
    joint_text = True

    def __init__(self, cfg: MiniMaxH3Config, backend: str = "sdpa"):
        super().__init__()
        self.diffusers_config = minimax_h3_config(cfg)
        self.patch = tuple(int(p) for p in cfg.patch_size)
        self.rope_freq_dim, self.rope_theta = int(cfg.rope_freq_dim), float(cfg.rope_theta)
        take_modules(self, MINIMAX_H3.model_class()(**self.diffusers_config), _MODULES)
        for block in self.transformer_blocks:
            block.attn.set_processor(PackedMiniMaxH3AttnProcessor())
            block.attn.attention_fn = LocalAttention(backend)  # swapped for CP by parallelize()

    def _captions(self, context: torch.Tensor | None, context_len: torch.Tensor | None, S: int) -> list[torch.Tensor]:
        """Each clip's refined caption [n_s, dim]: context_embedder then the token refiner over its
        valid tokens alone (one clip, one document, as diffusers on one sample)."""
        if context is None or S == 0:
            return []
        w = self.context_embedder.weight
        lens = [int(n) for n in (context_len if context_len is not None else [context.shape[1]] * S)]
        return [self.token_refiner(self.context_embedder(context[s, :n].to(w.dtype))[None])[0] for s, n in enumerate(lens)]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                context: torch.Tensor | None = None, context_len: torch.Tensor | None = None,
                clean: torch.Tensor | None = None, stream: torch.Tensor | None = None,
                text: torch.Tensor | None = None) -> torch.Tensor:
        S, L = t.shape[0], x.shape[0]
        is_text = (text > 0) & (seg >= 0) if text is not None else torch.zeros_like(seg, dtype=torch.bool)
        is_audio = (stream == AUDIO) & ~is_text if stream is not None else torch.zeros_like(is_text)
        tag = torch.where(is_text, TEXT_TAG, torch.where(is_audio, AUDIO_TAG, VIDEO_TAG))
        # time rows: clip s at 1 − t_s (MiniMax: 1 = clean), row S clean (given tokens, padding)
        given = (seg < 0) if clean is None else (seg < 0) | (clean & ~is_text)
        row = torch.where(given, torch.full_like(seg, S), seg)
        tau = torch.cat([1.0 - t.float(), t.new_ones(1, dtype=torch.float32)])
        temb = self.time_embedder(self.time_proj(tau).to(self.time_embedder.linear_1.weight.dtype))  # [S+1, time_dim]
        iv, ia, it = [torch.nonzero(m).flatten() for m in (~is_text & ~is_audio, is_audio, is_text)]
        cv, ca = self.proj_in.in_features, self.audio_proj_in.in_features
        w = self.proj_in.weight  # inputs arrive in fp32 under FSDP2 mixed precision
        width = lambda y, c: nn.functional.pad(y, (0, max(0, c - y.shape[1])))[:, :c].to(w.dtype)  # noqa: E731
        hv, ha = self.proj_in(width(x[iv], cv)), self.audio_proj_in(width(x[ia], ca))
        captions = self._captions(context, context_len, S)
        h = hv.new_zeros(L, hv.shape[1]).index_copy(0, iv, hv).index_copy(0, ia, ha.to(hv.dtype))
        if not captions and context is not None:  # a pack without clips: a dummy caption, times 0 (FSDP2, below)
            dummy = self.context_embedder(x.new_zeros(1, 1, self.context_embedder.in_features).to(w.dtype))
            h = h + 0.0 * self.token_refiner(dummy).sum().to(h.dtype)
        if captions:
            flat, start = torch.cat(captions), torch.tensor([0] + [c.shape[0] for c in captions]).cumsum(0)[:-1]
            if it.numel():  # (no slots: text None, or a CP rank without any)
                h = h.index_copy(0, it, flat[start.to(seg.device)[seg[it]] + text[it] - 1].to(h.dtype))
            # a CP rank without caption slots (or audio) keeps the modules in its graph with an exact
            # zero: every rank's gradient reduction then covers the same parameters (FSDP2)
            h = h + 0.0 * flat.sum().to(h.dtype)
        h = h + 0.0 * ha.sum().to(h.dtype)
        text_len = (context_len if context_len is not None and captions else torch.tensor(
            [c.shape[0] for c in captions] or [0] * S, dtype=torch.long)).to(seg.device)
        # the clips' grids from the whole pack: under CP the layout keeps its positions (a rank holds part of a clip)
        full_pos = getattr(meta, "full_pos", None)  # (CPAttnLayout's; a VarlenLayout's pack is whole)
        grid = clip_grids(pos, seg, S) if full_pos is None else clip_grids(full_pos, meta.seg, S)
        cos, sin = _rotation(positions(pos, seg, tag, text if text is not None else torch.zeros_like(seg), text_len,
                                       grid, self.patch).float(), self.rope_freq_dim, self.rope_theta)
        rope, adaln = PackedRope(cos, sin, meta), row * 3 + tag
        h = h[None]
        for block in self.transformer_blocks:
            h = block(h, temb, adaln, rope)
        h = self.norm_out(h, temb, row)[0].to(self.proj_out.weight.dtype)
        out_v, out_a = -self.proj_out(h[iv]), -self.audio_proj_out(h[ia])  # MiniMax's x0 − ε -> our ε − x0
        # as wide as the pack's inputs (a pack without any audio, e.g. a rank's empty one, is the video's width)
        width = out_v.shape[1] if stream is None else max(out_v.shape[1], x.shape[1])
        pad = lambda y: nn.functional.pad(y, (0, width - y.shape[1]))  # noqa: E731
        out = out_v.new_zeros(L, width).index_copy(0, iv, pad(out_v))
        return out.index_copy(0, ia, pad(out_a).to(out.dtype)) + 0.0 * out_a.sum()


register_model(MINIMAX_H3.spec(
    name="minimax_h3", config=MiniMaxH3Config, mode=Mode.video,
    build=lambda cfg, backend="sdpa": PackedMiniMaxH3(cfg, backend),
    # measured with saved_tensors_hooks on PackedMiniMaxH3's block at d = 64, SwiGLU 128 (perf/memory.py
    # calibrate_block: 7994 B/token fp32, 5145 under bf16 autocast; tests/test_planner.py re-measures);
    # selective_d is HunyuanVideo 1.5's (not measured for this block)
    activations=lambda cfg: ActivationModel(fp32_d=27.0, autocast_f32_d=8, autocast_lp_d=19.7, outside_d=6,
                                            selective_d=10.5),
    blocks=lambda m: m.transformer_blocks,
    block_linears=joint_attention_linears,  # text, audio and video alike
    io_linears=lambda m: [m.proj_in, m.proj_out],
    io_dim=lambda cfg: cfg.in_channels * math.prod(cfg.patch_size),
    hidden=lambda cfg: cfg.ffn_dim,
    # the blocks' attention and SwiGLU (the token refiner's, of the same names, stay frozen)
    lora_targets=r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
    joint_text=True,
    audio_positions="index",  # an audio token's pos[:, 0]: its index in the clip's track
    silent_ok=True,  # a clip without sound: its text and video tokens alone
    vae_stride=(4, 16, 16),  # MiniMax-H3's video VAE: 16x in height and width (vae_spatial_compression_ratio)
))
