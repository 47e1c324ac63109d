"""diffusers' LTX2VideoTransformer3DModel (LTX-2: video + audio) trained through our packed path.

`PackedLTX2` holds the very submodules of a diffusers `LTX2VideoTransformer3DModel` under the same
names, in the same order, so its state dict IS a diffusers state dict (folders load 1:1, trained
weights export back with `save_pretrained`). Only the forward is ours: several clips, each with its
video tokens and then its audio tokens (tasks/joint_audio.py: `stream` 0 / 1, the clip's `seg`),
share one flat token sequence, which FSDP2 and Ulysses/ring CP split like any pack.

Each block is diffusers' own `LTX2VideoTransformerBlock.forward`, given the pack's video tokens and
its audio tokens as its two batches of one. What reaches its attention processors instead of RoPE
tables is `StreamTokens` (the rotation of the stream's local tokens, where they sit in the pack,
and the pack's per-stream attention layouts), so `PackedLTX2AttnProcessor` attends

- video self-attention (attn1): a clip's video tokens to its video tokens;
- audio self-attention (audio_attn1): a clip's audio tokens to its audio tokens;
- audio-to-video (audio_to_video_attn): a clip's video queries to ITS audio keys only, and
  video-to-audio the other way round — per sample, as diffusers' forward does on one clip; a clip
  without audio gets nothing from the audio (its a2v output is 0, as diffusers' with
  `isolate_modalities`), and its video trains alone;
- text (attn2, audio_attn2): each token to its own clip's caption (valid tokens only).

The four token-to-token attentions go through each layer's `attention_fn` (swapped for CP by
parallelize) with a layout derived from the pack's (`restricted`: per-stream segment ids, and for
a2v / v2a the keys' own ids), so Ulysses and ring split them like any attention; the RoPE of each
token depends only on its own position (video (t, h, w) in pixels and seconds, audio its index in
the clip's track: diffusers' coordinates, by its own `prepare_*_coords` and rotary modules).

Inputs and outputs are [L, max(video patch, audio_patch)] (zero-padded), as for the two-stream DiT.
No parallelism here (no torch.distributed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

import torch
from torch import nn

from dit_train.config.choices import Mode
from dit_train.config.schema import VideoModelConfig
from dit_train.kernels import packed_cross_attention
from dit_train.models.diffusers_family import DiffusersFamily
from dit_train.models.family_forward import caption_batch, PackedContext, take_modules, time_rows
from dit_train.models.lora_formats import KeyMap
from dit_train.models.registry import ActivationModel, register_model
from dit_train.kernels import LocalAttention

VIDEO, AUDIO = 0, 1  # PackedBatch.stream values (dit_train.batch.STREAMS)


@dataclass
class LTX2Config(VideoModelConfig):
    """diffusers' LTX2VideoTransformer3DModel through the packed path (`model.name=ltx2`)."""

    name: str = "ltx2"
    # Local diffusers folder (config.json + safetensors of an LTX2VideoTransformer3DModel, or a
    # pipeline folder holding transformer/) to start from; "" = initialise from train.seed.
    pretrained: str = ""
    allow_pickle_weights: bool = False  # as model=ltx: .bin/.pt weights only from a source you trust
    norm_eps: float = 1e-6
    # features of an audio token (the transformer's audio_in_channels): waveform samples per token
    # on the embedded world (640 = LTX-2's 160-sample hop x 4: 25 tokens a second, as its audio
    # latents); 128 for LTX-2's audio-VAE latents
    audio_patch: int = 640
    audio_dim: int = 64  # audio stream width (audio heads x audio head dim)
    audio_heads: int = 4
    # frame rate of the clips (LTX2Pipeline's frame_rate): video RoPE's time axis is in seconds
    fps: float = 24.0
    # VAE compression (t, h, w) (the transformer's vae_scale_factors): RoPE positions are in pixels
    vae_scale: List[int] = field(default_factory=lambda: [8, 32, 32])
    # diffusers' rope_type: interleaved (LTX-2.0) or split
    rope_type: str = "interleaved"


# Key of our config for each LTX2VideoTransformer3DModel config key (for clear mismatch errors).
_OUR_KEY = {"in_channels": "(in_channels + cond_channels) x patch volume", "out_channels": "in_channels x patch volume",
            "patch_size": "patch_size[1] (= patch_size[2])", "patch_size_t": "patch_size[0]",
            "num_attention_heads": "heads", "attention_head_dim": "dim / heads", "cross_attention_dim": "dim",
            "vae_scale_factors": "vae_scale", "audio_in_channels": "audio_patch", "audio_out_channels": "audio_patch",
            "audio_num_attention_heads": "audio_heads", "audio_attention_head_dim": "audio_dim / audio_heads",
            "audio_cross_attention_dim": "audio_dim", "num_layers": "depth", "caption_channels": "text_dim",
            "norm_eps": "norm_eps", "rope_type": "rope_type"}
# LTX2VideoTransformer3DModel keys our packed forward assumes (LTX-2.0's; a folder with others is refused)
_FIXED = {"activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False,
          "attention_bias": True, "attention_out_bias": True, "gated_attn": False, "cross_attn_mod": False,
          "audio_gated_attn": False, "audio_cross_attn_mod": False, "perturbed_attn": False,
          "use_prompt_embeddings": True, "ff_bias": True, "audio_ff_bias": True,
          "use_keyframes_abs_pos_embedding": False, "audio_patch_size": 1, "audio_patch_size_t": 1,
          "timestep_scale_multiplier": 1000, "cross_attn_timestep_scale_multiplier": 1000}


def ltx2_config(cfg: LTX2Config) -> dict[str, Any]:
    """LTX2VideoTransformer3DModel(**kwargs) of the same shape as `cfg` (model.name=ltx2)."""
    if cfg.dim % cfg.heads or cfg.audio_dim % cfg.audio_heads:
        raise ValueError(f"model.dim={cfg.dim} / model.heads={cfg.heads} and model.audio_dim={cfg.audio_dim} / "
                         f"model.audio_heads={cfg.audio_heads} must divide")
    if cfg.text_dim <= 0:
        raise ValueError("model.name=ltx2 needs model.text_dim > 0 (width of the caption embeddings; 3840 for LTX-2's "
                         "Gemma 3 features)")
    if cfg.audio_patch <= 0:
        raise ValueError(f"model.audio_patch={cfg.audio_patch} must be > 0 (features of an audio token)")
    if len(cfg.patch_size) != 3 or cfg.patch_size[1] != cfg.patch_size[2]:
        raise ValueError(f"model.patch_size={list(cfg.patch_size)} must be [t, p, p] (LTX patches are square)")
    if cfg.rope_theta != 10000.0 or cfg.mlp_ratio != 4.0:
        raise ValueError(f"model.rope_theta={cfg.rope_theta} / model.mlp_ratio={cfg.mlp_ratio}: LTX-2's are fixed at "
                         "10000 / 4; remove the override")
    if len(cfg.vae_scale) != 3 or cfg.rope_type not in ("interleaved", "split") or cfg.fps <= 0:
        raise ValueError(f"model.vae_scale={list(cfg.vae_scale)} must be [t, h, w], model.rope_type={cfg.rope_type!r} "
                         f"interleaved or split, model.fps={cfg.fps} > 0")
    vol = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    return dict(in_channels=(cfg.in_channels + cfg.cond_channels) * vol, out_channels=cfg.in_channels * vol,
                patch_size=cfg.patch_size[1], patch_size_t=cfg.patch_size[0], num_attention_heads=cfg.heads,
                attention_head_dim=cfg.dim // cfg.heads, cross_attention_dim=cfg.dim,
                vae_scale_factors=tuple(int(s) for s in cfg.vae_scale), audio_in_channels=cfg.audio_patch,
                audio_out_channels=cfg.audio_patch, audio_num_attention_heads=cfg.audio_heads,
                audio_attention_head_dim=cfg.audio_dim // cfg.audio_heads, audio_cross_attention_dim=cfg.audio_dim,
                num_layers=cfg.depth, caption_channels=cfg.text_dim, norm_eps=cfg.norm_eps, rope_type=cfg.rope_type)


def pipeline_notes(cfg: LTX2Config) -> list[str]:
    """Why an export of `cfg` loads (from_pretrained) but is no transformer of diffusers'
    LTX2Pipeline: the pipeline makes latents of transformer.config.in_channels channels and packs
    them with its patch_size, while our in_channels already counts the patch volume, so only patch
    [1, 1, 1] (LTX-2's own) matches. [] when it is one."""
    if list(cfg.patch_size) == [1, 1, 1]:
        return []
    return [f"model.patch_size={list(cfg.patch_size)}: this folder loads with LTX2VideoTransformer3DModel."
            "from_pretrained but is no LTX2Pipeline transformer (the pipeline packs its latents with patch 1 only "
            "as we export them); a run for the pipeline has model.patch_size=[1,1,1], the VAEs' latent channels as "
            "model.in_channels and model.audio_patch "
            "(docs/audio-video.md#sampling-an-export-in-diffusers-ltx2pipeline)"]


# LTX-2's LoRA names: the blocks' as diffusers' (ComfyUI's comfy/ldm/lightricks/av_model.py
# BasicAVTransformerBlock: attn1, audio_attn1, attn2, audio_attn2, audio_to_video_attn, video_to_audio_attn,
# ff, audio_ff), the input projections the original's patchify_proj (diffusers'
# _convert_non_diffusers_ltx2_lora_to_diffusers renames them back); that reader drops `.alpha`: alpha folded
LTX2_LORA_KEYS = KeyMap("LTX-2", blocks={"transformer_blocks": ("transformer_blocks", None)},
                        top={"proj_in": "patchify_proj", "audio_proj_in": "audio_patchify_proj", "proj_out": "proj_out",
                             "audio_proj_out": "audio_proj_out"},
                        alpha=False, unmapped="mapped: the blocks' linears, proj_in, audio_proj_in, proj_out, audio_proj_out")

LTX2 = DiffusersFamily(class_name="LTX2VideoTransformer3DModel", kwargs=ltx2_config, our_keys=_OUR_KEY, fixed=_FIXED,
                       folder_kind="an LTX-2 folder", article="an", export_notes=pipeline_notes, lora_keys=LTX2_LORA_KEYS)

# the diffusers modules PackedLTX2 holds, in LTX2VideoTransformer3DModel's order (= its state dict's)
_MODULES = ("proj_in", "audio_proj_in", "caption_projection", "audio_caption_projection", "time_embed",
            "audio_time_embed", "av_cross_attn_video_scale_shift", "av_cross_attn_audio_scale_shift",
            "av_cross_attn_video_a2v_gate", "av_cross_attn_audio_v2a_gate", "scale_shift_table",
            "audio_scale_shift_table", "rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope",
            "transformer_blocks", "norm_out", "proj_out", "audio_norm_out", "audio_proj_out")


def _rows(v: torch.Tensor, idx: torch.Tensor, fill: Any) -> torch.Tensor:
    """v[idx], or one `fill` row when a stream has no local token (a pack, or a CP rank's share of
    one, without audio): diffusers' blocks cannot modulate an empty batch, so the stream runs one
    placeholder token that attends nothing and is dropped."""
    return v[idx] if idx.numel() else torch.full((1, *v.shape[1:]), fill, dtype=v.dtype, device=v.device)


class StreamTokens:
    """What a block passes untouched to its attention processors as a rotary embedding: one
    stream's local tokens. cos, sin: diffusers' rotation of each ([1, n, C] or split's per-head
    form); index: [n] where they sit among the L local tokens of the pack (empty: the stream's one
    placeholder row, `_rows`); stream: VIDEO or AUDIO;
    layouts: {(query stream, key stream): attention layout of the pack} (shared by the four
    holders of a forward); length: L; paired: [n, 1] 1 where the token's clip has tokens of the
    other stream, else 0. A plain class, so FSDP's input cast leaves the fp32 angles alone."""

    __slots__ = ("cos", "sin", "index", "stream", "layouts", "length", "paired")

    def __init__(self, cos, sin, index: torch.Tensor, stream: int, layouts: dict, length: int, paired: torch.Tensor):
        self.cos, self.sin, self.index, self.stream, self.layouts = cos, sin, index, stream, layouts
        self.length, self.paired = length, paired


def _rotate(x: torch.Tensor, attn: nn.Module, tokens: StreamTokens) -> torch.Tensor:
    """diffusers' own rotary application of the layer's rope_type on x [1, n, C]."""
    # deferred: diffusers takes ~2 s to import; only LTX-2 runs need it
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb

    rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
    return rotate(x, (tokens.cos, tokens.sin))


class PackedLTX2AttnProcessor:
    """LTX2Attention processor for a pack (hidden_states [1, n, C]: one stream's local tokens).

    Text cross-attention (encoder_hidden_states a PackedContext): each token attends to its own
    clip's caption. Otherwise (self or cross-stream; query_rotary_emb / key_rotary_emb are
    StreamTokens): q, k, v with diffusers' projections, norms and RoPE, placed at their tokens'
    rows of the pack ([L, H, D], zeros elsewhere) and attended with `attn.attention_fn` under the
    layout of the (query stream, key stream) pair; the query rows come back."""

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, query_rotary_emb: StreamTokens | None = None,
                 key_rotary_emb: StreamTokens | None = None) -> torch.Tensor:
        if isinstance(encoder_hidden_states, PackedContext):  # text: no RoPE, per-clip captions
            ctx = encoder_hidden_states
            q = attn.norm_q(attn.to_q(hidden_states[0])).unflatten(-1, (attn.heads, -1))
            k = attn.norm_k(attn.to_k(ctx.states)).unflatten(-1, (attn.heads, -1))
            v = attn.to_v(ctx.states).unflatten(-1, (attn.heads, -1))
            out = packed_cross_attention(q, k, v, ctx.seg, ctx.lengths)
        else:
            qt = query_rotary_emb
            kt = qt if key_rotary_emb is None else key_rotary_emb
            src = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            q = _rotate(attn.norm_q(attn.to_q(hidden_states)), attn, qt)[0]
            k = _rotate(attn.norm_k(attn.to_k(src)), attn, kt)[0]
            v = attn.to_v(src)[0]

            def placed(y: torch.Tensor, tokens: StreamTokens) -> torch.Tensor:  # [n, C] -> [L, H, D]
                y = y[: tokens.index.numel()].unflatten(-1, (attn.heads, -1))  # (not a stream's placeholder row)
                return y.new_zeros(tokens.length, *y.shape[1:]).index_copy(0, tokens.index, y)

            Q, K, V = placed(q, qt), placed(k, kt), placed(v, kt)
            out = attn.attention_fn(Q, K, V, qt.layouts[(qt.stream, kt.stream)])[qt.index]
            out = torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])  # the placeholder's
            # a pack (or CP rank) without audio sees no key here: keep the projections in the graph
            # with an exact zero, so every rank's parameters get a gradient (DDP / FSDP2)
            out = out + 0.0 * (Q.sum() + K.sum() + V.sum())
        out = attn.to_out[1](attn.to_out[0](out.flatten(1).to(hidden_states.dtype)))
        if key_rotary_emb is not None and key_rotary_emb.stream != query_rotary_emb.stream:
            # a clip without sound hears nothing (not to_out's bias): diffusers' isolate_modalities
            out = out * query_rotary_emb.paired.to(out.dtype)
        return out[None]


def _video_rope(model: nn.Module, pos: torch.Tensor, patch: tuple[int, int, int], fps: float):
    """diffusers' (self, cross-stream) rotations [1, n, ·] of video tokens at patch positions pos [n, 3]:
    its `prepare_video_coords` over a grid that covers them, then each token's coordinates."""
    grid = [int(pos[:, a].max()) + 1 if pos.shape[0] else 1 for a in range(3)]
    coords = model.rope.prepare_video_coords(1, grid[0] * patch[0], grid[1] * patch[1], grid[2] * patch[2],
                                             pos.device, fps=fps)  # [1, 3, N, 2]
    flat = (pos[:, 0] * grid[1] + pos[:, 1]) * grid[2] + pos[:, 2]
    coords = coords[:, :, flat]
    return model.rope(coords), model.cross_attn_rope(coords[:, 0:1])


def _audio_rope(model: nn.Module, index: torch.Tensor):
    """diffusers' (self, cross-stream) rotations of audio tokens that are the index [n]-th of their
    clip's track: its `prepare_audio_coords`, then each token's."""
    n = int(index.max()) + 1 if index.numel() else 1
    coords = model.audio_rope.prepare_audio_coords(1, n, index.device)[:, :, index]  # [1, 1, n, 2]
    return model.audio_rope(coords), model.cross_attn_audio_rope(coords)


class PackedLTX2(nn.Module):
    """Packed-sequence forward over a diffusers LTX2VideoTransformer3DModel's modules.

    forward(x [L, max(C_in·pt·ph·pw, audio_patch)], pos [L, 3], seg [L], t [S], meta,
    context [S, Lc, text_dim] = None, context_len [S] = None, clean [L] = None, stream [L] = None)
    -> [L, max(C·pt·ph·pw, audio_patch)]: the predicted velocity of every token (a video token's
    in its first C·pt·ph·pw values, an audio token's in its first audio_patch, zeros after);
    without `stream` (video only) [L, C·pt·ph·pw].
    The arguments are models/family_forward.py's; stream (0 video, 1 audio; None = all video) is
    PackedBatch.stream, and an audio token's pos[:, 0] is its index in its clip's track.
    """

    zero_init = ("proj_out", "audio_proj_out")  # from scratch, both heads start at rest
    output_head = "proj_out"  # LoRA on a base where it is all zero cannot learn (engine/sanity.py)

    def __init__(self, cfg: LTX2Config, backend: str = "sdpa"):
        super().__init__()
        self.diffusers_config = ltx2_config(cfg)
        self.patch, self.fps = tuple(cfg.patch_size), float(cfg.fps)
        take_modules(self, LTX2.model_class()(**self.diffusers_config), _MODULES)
        for block in self.transformer_blocks:
            for name in ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"):
                layer = getattr(block, name)
                layer.set_processor(PackedLTX2AttnProcessor())
                if name not in ("attn2", "audio_attn2"):  # token-to-token: swappable for CP by parallelize()
                    layer.attention_fn = LocalAttention(backend)

    @staticmethod
    def _layouts(meta: Any, stream: torch.Tensor, S: int) -> tuple[dict, torch.Tensor]:
        """({(query stream, key stream): layout}, [S, 2] bool clip has tokens of stream s) from the
        pack's `meta` (its `seg` is the full pack's; its `stream` under CP, else the local = full
        `stream`): self-attention inside a clip's own stream, cross-stream attention from a clip's
        one stream to its other."""
        full = getattr(meta, "stream", None)
        full = stream if full is None else full
        seg = meta.seg
        valid = seg >= 0
        has = torch.zeros(S * 2, dtype=torch.bool, device=seg.device)
        has[(seg * 2 + full)[valid]] = True
        of = lambda s, none: torch.where(valid & (full == s), seg, torch.full_like(seg, none))  # noqa: E731
        # video self: ids 2b (video) / 2b+1 (audio) keep the contiguous fast path; the audio
        # segments it also computes are discarded (a few tokens a clip)
        both = torch.where(valid, 2 * seg + full, seg)
        return {(VIDEO, VIDEO): meta.restricted(both), (AUDIO, AUDIO): meta.restricted(of(AUDIO, -1), of(AUDIO, -2)),
                (VIDEO, AUDIO): meta.restricted(of(VIDEO, -1), of(AUDIO, -2)),
                (AUDIO, VIDEO): meta.restricted(of(AUDIO, -1), of(VIDEO, -2))}, has.view(S, 2)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                context: torch.Tensor | None = None, context_len: torch.Tensor | None = None,
                clean: torch.Tensor | None = None, stream: torch.Tensor | None = None) -> torch.Tensor:
        S, L = t.shape[0], x.shape[0]
        video_only = stream is None  # (the sampler's packs): the output is as wide as the video's
        stream = torch.zeros_like(seg) if stream is None else stream
        iv, ia = torch.nonzero(stream != AUDIO).flatten(), torch.nonzero(stream == AUDIO).flatten()
        row, timestep = time_rows(t, seg, clean)  # [L], [R]: one time-embedding row per clip
        R = timestep.shape[0]
        rv, ra = _rows(row, iv, R - 1), _rows(row, ia, R - 1)  # [Lv], [La] (a placeholder reads the padding row)
        cv, ca = self.proj_in.in_features, self.audio_proj_in.in_features
        w = self.proj_in.weight  # inputs arrive in fp32 under FSDP2 mixed precision
        # each stream's features first, zeros after (a pack without audio, as the sampler's, is only
        # as wide as the video: the audio placeholder is widened)
        width = lambda y, c: nn.functional.pad(y, (0, max(0, c - y.shape[1])))[:, :c].to(w.dtype)  # noqa: E731
        hv = self.proj_in(width(_rows(x, iv, 0), cv))[None]  # [1, Lv, dim]
        ha = self.audio_proj_in(width(_rows(x, ia, 0), ca))[None]  # [1, La, audio_dim]
        # diffusers' time embeddings, per clip (rows), then read per token; the a2v / v2a gates' timestep
        # is scaled by cross_attn / timestep multipliers (both 1000: fixed)
        temb, emb = self.time_embed(timestep, batch_size=R, hidden_dtype=hv.dtype)  # [R, 6·dim], [R, dim]
        temb_a, emb_a = self.audio_time_embed(timestep, batch_size=R, hidden_dtype=hv.dtype)
        ca_v = self.av_cross_attn_video_scale_shift(timestep, batch_size=R, hidden_dtype=hv.dtype)[0]  # [R, 4·dim]
        ca_a = self.av_cross_attn_audio_scale_shift(timestep, batch_size=R, hidden_dtype=hv.dtype)[0]
        gate_v = self.av_cross_attn_video_a2v_gate(timestep, batch_size=R, hidden_dtype=hv.dtype)[0]  # [R, dim]
        gate_a = self.av_cross_attn_audio_v2a_gate(timestep, batch_size=R, hidden_dtype=hv.dtype)[0]
        context, lengths = caption_batch(context, context_len, S, self.caption_projection.linear_1.in_features, x)
        context = context.to(self.caption_projection.linear_1.weight.dtype)
        ctx_v = PackedContext(self.caption_projection(context), _rows(seg, iv, -1), lengths)  # [S, Lc, dim]
        ctx_a = PackedContext(self.audio_caption_projection(context), _rows(seg, ia, -1), lengths)  # [S, Lc, audio_dim]
        layouts, has = self._layouts(meta, stream, S)
        # per local token: does its clip have the other stream (padding: no)
        paired = torch.where(seg >= 0, has[seg.clamp_min(0), 1 - stream.clamp(0, 1)], False)[:, None]
        v_self, v_cross = _video_rope(self, _rows(pos, iv, 0), self.patch, self.fps)
        a_self, a_cross = _audio_rope(self, _rows(pos, ia, 0)[:, 0])
        tokens = lambda r, idx, s: StreamTokens(r[0], r[1], idx, s, layouts, L, _rows(paired, idx, False))  # noqa: E731
        rope_v, rope_a = tokens(v_self, iv, VIDEO), tokens(a_self, ia, AUDIO)
        cross_v, cross_a = tokens(v_cross, iv, VIDEO), tokens(a_cross, ia, AUDIO)
        for block in self.transformer_blocks:
            hv, ha = block(hv, ha, ctx_v, ctx_a, temb[rv][None], temb_a[ra][None], ca_v[rv][None], ca_a[ra][None],
                           gate_v[rv][None], gate_a[ra][None], None, None, rope_v, rope_a, cross_v, cross_a)
        shift, scale = (self.scale_shift_table[None] + emb[:, None]).unbind(1)  # [R, dim] each
        out_v = self.proj_out(self.norm_out(hv[0]) * (1 + scale[rv]) + shift[rv])
        shift, scale = (self.audio_scale_shift_table[None] + emb_a[:, None]).unbind(1)
        out_a = self.audio_proj_out(self.audio_norm_out(ha[0]) * (1 + scale[ra]) + shift[ra])
        # as wide as the pack's inputs: a pack without audio tokens (silent films, a rank's empty
        # micro-batch) is the video's width, as its target is
        width = out_v.shape[1] if video_only else max(out_v.shape[1], x.shape[1])
        pad = lambda y: nn.functional.pad(y, (0, width - y.shape[1]))  # noqa: E731
        out_v, out_a = pad(out_v)[: iv.numel()], pad(out_a)[: ia.numel()].to(out_v.dtype)  # placeholders dropped
        return out_v.new_zeros(L, width).index_copy(0, iv, out_v).index_copy(0, ia, out_a)


# --------------------------------------------------------------------------- the family


def _block_linears(b: nn.Module) -> list[nn.Module]:
    """The matmuls a block applies to each video token (FLOPs per token; the audio stream's are
    counted per audio token by the same list's shapes only roughly: audio tokens are few)."""
    a1, a2, a2v, v2a = b.attn1, b.attn2, b.audio_to_video_attn, b.video_to_audio_attn
    return [a1.to_q, a1.to_k, a1.to_v, a1.to_out[0], a2.to_q, a2.to_out[0], a2v.to_q, a2v.to_out[0], v2a.to_k,
            v2a.to_v, b.ff.net[0].proj, b.ff.net[2]]


register_model(LTX2.spec(
    name="ltx2", config=LTX2Config, mode=Mode.video, build=lambda cfg, backend="sdpa": PackedLTX2(cfg, backend),
    # measured with saved_tensors_hooks on LTX2VideoTransformerBlock run by PackedLTX2 at d = 64 on
    # video tokens (perf/memory.py calibrate_block: 14 295 B/token fp32, 10 936 under bf16 autocast;
    # tests/test_planner.py re-measures); the audio stream's own activations (a few tokens a clip)
    # are not modelled; selective_d is LTX-1's, not measured for LTX-2
    activations=lambda cfg: ActivationModel(fp32_d=47.8, autocast_f32_d=16, autocast_lp_d=45.4, outside_d=6,
                                            selective_d=10.5),
    blocks=lambda m: m.transformer_blocks,
    block_linears=_block_linears,
    io_linears=lambda m: [m.proj_in, m.proj_out],
    io_dim=lambda cfg: (cfg.in_channels + cfg.cond_channels) * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2],
    hidden=lambda cfg: 4 * cfg.dim,
    # both streams: attn1/attn2/a2v/v2a and audio_attn1/audio_attn2's q/k/v/out, ff and audio_ff
    # (peft matches whole name parts: "ff.net.2" is not audio_ff's)
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj",
                  "audio_ff.net.2"),
    vae_stride=(8, 32, 32),  # LTX-2's video VAE: 8x in time (plus the first frame), 32x in height and width
    audio_positions="index",  # an audio token's pos[:, 0]: its index in the clip's track
    silent_ok=True,  # data.audio=false: the video stream alone (a clip without sound hears nothing)
))
