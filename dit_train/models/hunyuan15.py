"""diffusers' HunyuanVideo15Transformer3DModel (HunyuanVideo 1.5) trained through our packed path.

`PackedHunyuan15` holds the very submodules of a diffusers `HunyuanVideo15Transformer3DModel`
under the same names (x_embedder, image_embedder, context_embedder, context_embedder_2,
time_embed, cond_type_embed, transformer_blocks.N.*, norm_out, proj_out), so its state dict IS
a diffusers state dict: pretrained folders load 1:1 and trained weights export back with
`save_pretrained`. Only the forwards are ours (`PackedHunyuan15Block` holds a diffusers block's
modules under their names), so that several clips share one flat token sequence:

- joint attention: HunyuanVideo 1.5's blocks attend over a clip's video tokens and its valid
  text tokens together (two streams: the text tokens have their own norms, projections and
  feed-forward). Here the text tokens of a clip are tokens of the pack themselves, right after
  the clip's video tokens, with the clip's seg and loss weight 0 (outside T_b: the metadata
  sync and every reduction are unchanged; `dit_train/tasks/joint_text.py` adds them). So the
  clip's attention run is exactly diffusers' joint attention (padding text never enters), and
  CP splits it like any other run: Ulysses and ring need nothing more;
- a text token's slot says which text token it is (`text` [L]: 1 + its index in the clip's
  valid text, 0 = a video or padding token); its state is the clip's refined text from the
  token refiner (`context_embedder`, run per clip on the caption, with the clip's timestep:
  replicated on every CP rank, it is per sample) or ByT5's projection (`context_embedder_2`),
  in diffusers' order [valid ByT5 | valid MLLM], plus `cond_type_embed`;
- patch embedding: the Conv3d (kernel = stride = patch) is a linear map on our (c, pt, ph, pw)
  features; the image-to-video input channels (`model.image_cond_channels`: conditioning
  latents and mask, zeros in text-to-video as HunyuanVideo15Pipeline feeds them) contribute
  nothing and are left out of the product; the output features are (c, pt, ph, pw) already;
- time: one embedding per clip (timestep = 1000·t), gathered per token; clean context tokens
  of cond.feed=timestep read their clip's embedding at t = 0;
- 3-D RoPE on video tokens only (text tokens are not rotated, as in diffusers), from each
  token's own (t, h, w) patch coordinates: under CP every rank rotates its local tokens.

The image branch (`image_embedder`, SigLIP tokens of image-to-video) is held for the state dict
but not run: text-to-video masks its tokens out entirely. No parallelism here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.config.choices import Mode
from dit_train.config.schema import VideoModelConfig
from dit_train.kernels import LocalAttention
from dit_train.models.diffusers_family import DiffusersFamily
from dit_train.models.family_forward import joint_attention_linears, take_modules, time_rows
from dit_train.models.lora_formats import KeyMap
from dit_train.models.registry import ActivationModel, register_model


@dataclass
class Hunyuan15Config(VideoModelConfig):
    """diffusers' HunyuanVideo15Transformer3DModel through the packed path (`model.name=hunyuan15`)."""

    name: str = "hunyuan15"
    rope_theta: float = 256.0  # HunyuanVideo 1.5's RoPE base
    # Local diffusers folder (config.json + safetensors of a HunyuanVideo15Transformer3DModel, or
    # a pipeline folder holding transformer/) to start from; "" = initialise from train.seed.
    pretrained: str = ""
    refiner_depth: int = 2  # token-refiner blocks over the caption (num_refiner_layers)
    text_2_dim: int = 1472  # width of the second text encoder's (ByT5) embeddings
    image_dim: int = 1152  # width of the SigLIP image embeddings (held, not run: text-to-video)
    # input channels the patch embedding has beyond the latents: image-to-video conditioning
    # latents and their mask (HunyuanVideo 1.5: 32 + 1), zeros in text-to-video (left out of the product)
    image_cond_channels: int = 0
    # RoPE channels per axis (t, h, w) of each head; they sum to dim / heads
    rope_axes: List[int] = field(default_factory=lambda: [4, 6, 6])
    target_size: int = 640  # pixel size the pipeline's resolution buckets follow (config only)
    task_type: str = "t2v"  # config only (t2v | i2v): written back on export
    # model.pretrained must hold safetensors weights (a pickle can run code on load); true also
    # accepts .bin/.pt weights from a source you trust
    allow_pickle_weights: bool = False


# Key of our config for each HunyuanVideo15Transformer3DModel config key (for clear mismatch errors).
_OUR_KEY = {"in_channels": "in_channels + image_cond_channels", "out_channels": "in_channels",
            "num_attention_heads": "heads", "attention_head_dim": "dim / heads", "num_layers": "depth",
            "num_refiner_layers": "refiner_depth", "mlp_ratio": "mlp_ratio", "patch_size": "patch_size[1] (= patch_size[2])",
            "patch_size_t": "patch_size[0]", "text_embed_dim": "text_dim", "text_embed_2_dim": "text_2_dim",
            "image_embed_dim": "image_dim", "rope_theta": "rope_theta", "rope_axes_dim": "rope_axes"}
# keys our packed forward assumes (a folder with others is refused)
_FIXED = {"qk_norm": "rms_norm", "use_meanflow": False}


def hunyuan15_config(cfg: Hunyuan15Config) -> dict[str, Any]:
    """HunyuanVideo15Transformer3DModel(**kwargs) of the same shape as `cfg` (model.name=hunyuan15)."""
    if cfg.dim % cfg.heads:
        raise ValueError(f"model.dim={cfg.dim} must be divisible by model.heads={cfg.heads}")
    if cfg.text_dim <= 0:
        raise ValueError("model.name=hunyuan15 needs model.text_dim > 0 (width of the caption embeddings; "
                         "3584 for Qwen2.5-VL-7B)")
    if len(cfg.patch_size) != 3 or cfg.patch_size[1] != cfg.patch_size[2]:
        raise ValueError(f"model.patch_size={list(cfg.patch_size)} must be [t, p, p] (HunyuanVideo patches are square)")
    if len(cfg.rope_axes) != 3 or sum(cfg.rope_axes) != cfg.dim // cfg.heads or any(a % 2 for a in cfg.rope_axes):
        raise ValueError(f"model.rope_axes={list(cfg.rope_axes)} must be 3 even numbers summing to model.dim / "
                         f"model.heads = {cfg.dim // cfg.heads}")
    if cfg.cond_channels:
        raise ValueError(f"cond.feed=concat/cond.control (model.cond_channels={cfg.cond_channels}): HunyuanVideo 1.5's "
                         f"input order differs from our concat feed; use cond.feed=timestep or no conditioning")
    return dict(in_channels=cfg.in_channels + cfg.image_cond_channels, out_channels=cfg.in_channels,
                num_attention_heads=cfg.heads, attention_head_dim=cfg.dim // cfg.heads, num_layers=cfg.depth,
                num_refiner_layers=cfg.refiner_depth, mlp_ratio=cfg.mlp_ratio, patch_size=cfg.patch_size[1],
                patch_size_t=cfg.patch_size[0], text_embed_dim=cfg.text_dim, text_embed_2_dim=cfg.text_2_dim,
                image_embed_dim=cfg.image_dim, rope_theta=cfg.rope_theta, rope_axes_dim=tuple(cfg.rope_axes),
                target_size=cfg.target_size, task_type=cfg.task_type)


# target_size and task_type are written back on export but not compared (not in _OUR_KEY)
# HunyuanVideo 1.5's LoRA names: its original checkpoint's, read in diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py (convert_hyvideo15_transformer_to_diffusers: double_blocks.N.
# img_attn_q -> transformer_blocks.N.attn.to_q, ...; final_layer.linear -> proj_out), the names musubi-tuner's
# HunyuanVideo 1.5 LoRAs use (networks/lora_hv_1_5.py adapts its MMDoubleStreamBlocks, prefix lora_unet).
# No maintained reader of such files exists to test against (diffusers has no HunyuanVideo 1.5 LoRA converter)
HUNYUAN15_LORA_KEYS = KeyMap("HunyuanVideo 1.5", blocks={"transformer_blocks": ("double_blocks", {
    "attn.to_q": "img_attn_q", "attn.to_k": "img_attn_k", "attn.to_v": "img_attn_v", "attn.to_out.0": "img_attn_proj",
    "attn.add_q_proj": "txt_attn_q", "attn.add_k_proj": "txt_attn_k", "attn.add_v_proj": "txt_attn_v",
    "attn.to_add_out": "txt_attn_proj", "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
    "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2",
    "norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear"})},
    top={"proj_out": "final_layer.linear"},
    unmapped="mapped: the double-stream blocks' attention, MLP and modulation linears, proj_out")

HUNYUAN15 = DiffusersFamily(class_name="HunyuanVideo15Transformer3DModel", kwargs=hunyuan15_config, our_keys=_OUR_KEY,
                            fixed=_FIXED, folder_kind="a HunyuanVideo 1.5 folder", lora_keys=HUNYUAN15_LORA_KEYS)


def hunyuan15_rope(pos: torch.Tensor, axes: tuple[int, int, int], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (cos, sin) [L, head_dim] of HunyuanVideo15RotaryPosEmbed for patch positions
    [L, 3] (t, h, w): diffusers' own `get_1d_rotary_pos_embed` per axis on each token's
    coordinate, concatenated t|h|w, so the values equal its grid's."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed  # deferred: diffusers takes ~2 s to import

    parts = [get_1d_rotary_pos_embed(d, pos[:, a].to(torch.float32), theta, use_real=True) for a, d in enumerate(axes)]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb (use_real, pairs (x[2i], x[2i+1])) on x [L, H, D], in fp32."""
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


class JointLayout:
    """What every block needs about the local tokens besides their states; built once per forward.

    vid / txt: [Lv] / [Lt] indices of the video (and padding) tokens and of the text tokens;
    inv: [L] the permutation putting cat(video rows, text rows) back in token order;
    mod_row: [L] row of each token in cat(video modulation rows, text modulation rows);
    cos / sin: [Lv, head_dim] RoPE of the video tokens; meta: attention metadata.
    A plain class, not a dataclass, so FSDP's input cast leaves the fp32 angles alone.
    """

    __slots__ = ("vid", "txt", "inv", "mod_row", "cos", "sin", "meta")

    def __init__(self, vid, txt, inv, mod_row, cos, sin, meta):
        self.vid, self.txt, self.inv, self.mod_row, self.cos, self.sin, self.meta = vid, txt, inv, mod_row, cos, sin, meta

    def merge(self, video: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Rows of the video tokens and of the text tokens -> [L, ...] in token order."""
        return torch.cat([video, text])[self.inv]


class PackedHunyuan15Block(nn.Module):
    """A HunyuanVideo15TransformerBlock's modules (same names) with a packed-sequence forward.

    forward(h [L, dim], temb [R, dim] time rows, lay: JointLayout) -> [L, dim]: adaLN-Zero
    modulation per token (the video stream's `norm1`, the text stream's `norm1_context`), the
    two streams' q/k/v (QK RMSNorm; RoPE on video), one `attn.attention_fn` over all tokens (each
    clip's video and text together), then each stream's output projection and feed-forward. The
    same ops as diffusers' block and HunyuanVideo15AttnProcessor2_0."""

    def __init__(self, block: nn.Module, backend: str):
        super().__init__()
        for name in ("norm1", "norm1_context", "attn", "norm2", "ff", "norm2_context", "ff_context"):
            setattr(self, name, getattr(block, name))
        self.attn.attention_fn = LocalAttention(backend)  # swapped for CP by parallelize()

    def _qkv(self, n: torch.Tensor, lay: JointLayout) -> tuple[torch.Tensor, ...]:
        a = self.attn
        nv, nt = n[lay.vid], n[lay.txt]
        heads = lambda y: y.unflatten(-1, (a.heads, -1))  # noqa: E731
        qv, kv, vv = heads(a.to_q(nv)), heads(a.to_k(nv)), heads(a.to_v(nv))
        qv, kv = apply_rope(a.norm_q(qv), lay.cos, lay.sin), apply_rope(a.norm_k(kv), lay.cos, lay.sin)
        qt, kt, vt = heads(a.add_q_proj(nt)), heads(a.add_k_proj(nt)), heads(a.add_v_proj(nt))
        qt, kt = a.norm_added_q(qt), a.norm_added_k(kt)
        return lay.merge(qv, qt), lay.merge(kv, kt), lay.merge(vv, vt)

    def forward(self, h: torch.Tensor, temb: torch.Tensor, lay: JointLayout) -> torch.Tensor:
        s = F.silu(temb)
        mod = torch.cat([self.norm1.linear(s), self.norm1_context.linear(s)])[lay.mod_row]  # [L, 6·dim]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=-1)
        # norm1.norm and norm1_context.norm are the same affine-free LayerNorm (likewise norm2*)
        n = self.norm1.norm(h) * (1 + scale_msa) + shift_msa
        q, k, v = self._qkv(n, lay)
        out = self.attn.attention_fn(q, k, v, lay.meta).flatten(1).to(q.dtype)  # [L, dim]
        a = self.attn
        out = lay.merge(a.to_out[1](a.to_out[0](out[lay.vid])), a.to_add_out(out[lay.txt]))
        h = h + out * gate_msa
        n = self.norm2(h) * (1 + scale_mlp) + shift_mlp
        return h + gate_mlp * lay.merge(self.ff(n[lay.vid]), self.ff_context(n[lay.txt]))


class PackedHunyuan15(nn.Module):
    """Packed-sequence forward over a diffusers HunyuanVideo15Transformer3DModel's modules.

    forward(x, pos, seg, t, meta, context=None, context_len=None, clean=None, text=None,
            context_2=None, context_2_len=None):
      x:    [L, C_in·pt·ph·pw]  noisy patches, features (c, pt, ph, pw); zeros on text slots
      pos:  [L, 3]           (t, h, w) patch coordinates inside each clip (unused on text slots)
      seg:  [L]              clip of each token (-1 = padding)
      t:    [S]              flow time of each clip in [0, 1]
      meta: attention metadata for `attention_fn` (VarlenLayout, or CPAttnLayout under CP)
      context: [S, Lc, text_dim] MLLM caption embeddings (valid tokens first); context_len [S]
      clean: [L] bool tokens given clean (cond.feed=timestep): their clip's embedding at t = 0
      text: [L] int64 1 + index of a text slot in its clip's valid text [ByT5 | MLLM], 0 = not
            text; None = the pack has no text slots (clips attend to themselves only)
      context_2: [S, L2, text_2_dim] ByT5 embeddings (valid first); context_2_len [S]; None = none
    returns [L, C·pt·ph·pw], the predicted velocity (0 on text slots).
    """

    zero_init = ("proj_out",)  # from scratch the model starts at rest (a pretrained folder brings its own)
    output_head = "proj_out"  # LoRA on a base where it is all zero cannot learn (engine/sanity.py)
    joint_text = True  # text tokens are slots of the pack (tasks/joint_text.py)

    def __init__(self, cfg: Hunyuan15Config, backend: str = "sdpa"):
        super().__init__()
        self.diffusers_config = hunyuan15_config(cfg)
        self.rope_axes, self.rope_theta = tuple(cfg.rope_axes), float(cfg.rope_theta)
        ref = HUNYUAN15.model_class()(**self.diffusers_config)
        take_modules(self, ref, ("x_embedder", "image_embedder", "context_embedder", "context_embedder_2", "time_embed",
                                 "cond_type_embed", "norm_out", "proj_out"))
        self.transformer_blocks = nn.ModuleList(PackedHunyuan15Block(b, backend) for b in ref.transformer_blocks)

    def _text_states(self, context, context_len, context_2, context_2_len, timestep: torch.Tensor,
                     S: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Each clip's text token states [S, L2 + Lc, dim], the valid ByT5 tokens [S] and L2:
        clip s's rows are [ByT5 (L2 rows) | MLLM (Lc rows)], valid tokens first in each."""
        w = self.context_embedder.proj_in.weight
        if context is None:  # one all-zero caption token per clip
            context = like.new_zeros(S, 1, self.diffusers_config["text_embed_dim"])
            context_len = torch.ones(S, dtype=torch.long, device=like.device)
        if context_len is None:
            context_len = torch.full((S,), context.shape[1], dtype=torch.long, device=context.device)
        mask = torch.arange(context.shape[1], device=context.device)[None] < context_len[:, None]
        # the token refiner sees the caption with its padding masked and the clip's timestep
        mllm = self.context_embedder(context.to(w.dtype), timestep.to(w.dtype), mask.long())
        mllm = mllm + self.cond_type_embed.weight[0]
        if context_2 is None:
            context_2 = like.new_zeros(S, 0, self.diffusers_config["text_embed_2_dim"])
            context_2_len = torch.zeros(S, dtype=torch.long, device=like.device)
        if context_2_len is None:
            context_2_len = torch.full((S,), context_2.shape[1], dtype=torch.long, device=context_2.device)
        byt5 = self.context_embedder_2(context_2.to(w.dtype)) + self.cond_type_embed.weight[1]
        return torch.cat([byt5, mllm.to(byt5.dtype)], dim=1), context_2_len, context_2.shape[1]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                context: torch.Tensor | None = None, context_len: torch.Tensor | None = None,
                clean: torch.Tensor | None = None, text: torch.Tensor | None = None,
                context_2: torch.Tensor | None = None, context_2_len: torch.Tensor | None = None) -> torch.Tensor:
        S = t.shape[0]
        is_text = (text > 0) & (seg >= 0) if text is not None else torch.zeros_like(seg, dtype=torch.bool)
        # text slots read their clip's time row even when given clean
        row, timestep = time_rows(t, seg, None if clean is None else clean & ~is_text)  # [L], [R]
        te = self.time_embed
        w = te.timestep_embedder.linear_1.weight  # inputs arrive in fp32 under FSDP2 mixed precision
        temb = te.timestep_embedder(te.time_proj(timestep).to(w.dtype))  # [R, dim]
        vid, txt = (~is_text).nonzero().squeeze(1), is_text.nonzero().squeeze(1)
        pw = self.x_embedder.proj.weight.flatten(1)  # [dim, C_all·vol]; the i2v channels (zero in t2v) left out
        hv = F.linear(x[vid].to(pw.dtype), pw[:, : x.shape[1]], self.x_embedder.proj.bias)
        ht, keep = hv.new_zeros(0, hv.shape[1]), None
        if text is not None and S == 0:  # an empty pack (a rank without samples): a dummy caption, times 0
            keep = 0.0 * self._text_states(None, None, None, None, timestep[:1], 1, x)[0].sum()
        elif text is not None:
            states, len2, L2 = self._text_states(context, context_len, context_2, context_2_len, timestep[:S], S, x)
            s_t, j = seg[txt], text[txt] - 1  # clip and index in [valid ByT5 | valid MLLM] of each text slot
            l2 = len2[s_t]
            col = torch.where(j < l2, j, L2 + j - l2)
            ht = states.flatten(0, 1)[s_t * states.shape[1] + col].to(hv.dtype)
            # a CP rank holding no text slot still runs the text modules into its graph (an exact
            # zero), so that every rank's gradient reduction covers the same parameters (FSDP2
            # reduce-scatters only parameters with a gradient: a mismatch hangs the collective)
            keep = 0.0 * states.sum() if not txt.numel() else None
        inv = torch.argsort(torch.cat([vid, txt]))
        R = timestep.shape[0]
        lay = JointLayout(vid, txt, inv, row + R * is_text.to(row.dtype),
                          *hunyuan15_rope(pos[vid], self.rope_axes, self.rope_theta), meta)
        h = lay.merge(hv, ht)
        if keep is not None:
            h = h + keep.to(h.dtype)
        for block in self.transformer_blocks:
            h = block(h, temb, lay)
        scale, shift = self.norm_out.linear(F.silu(temb).to(h.dtype)).chunk(2, dim=-1)  # AdaLayerNormContinuous
        h = self.norm_out.norm(h) * (1 + scale[row]) + shift[row]
        out = self.proj_out(h)  # [L, (c, pt, ph, pw)], diffusers' output features
        return torch.where(is_text[:, None], torch.zeros_like(out), out)


# --------------------------------------------------------------------------- the family


register_model(HUNYUAN15.spec(
    name="hunyuan15", config=Hunyuan15Config, mode=Mode.video,
    build=lambda cfg, backend="sdpa": PackedHunyuan15(cfg, backend),
    # measured with saved_tensors_hooks on PackedHunyuan15Block over video tokens at d = 64
    # (perf/memory.py calibrate_block: 8516 B/token fp32, 5050 B/token under bf16 autocast;
    # tests/test_planner.py re-measures every registered model). Text slots add their own
    # activations (the text stream's, same per-token size) on top of the video tokens counted.
    # selective_d is LTX's (not measured for this block)
    activations=lambda cfg: ActivationModel(fp32_d=25.3, autocast_f32_d=8, autocast_lp_d=15.45, outside_d=6,
                                            selective_d=10.5),
    blocks=lambda m: m.transformer_blocks,
    block_linears=joint_attention_linears,  # the video stream's (text-stream linears act on text only)
    io_linears=lambda m: [m.x_embedder.proj, m.proj_out],
    io_dim=lambda cfg: cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2],
    hidden=lambda cfg: int(cfg.dim * cfg.mlp_ratio),
    # both streams of the double-stream blocks (video q/k/v/out and feed-forward, text
    # add_*_proj/to_add_out and ff_context); a regex, so the token refiner's to_q/ff stay frozen
    lora_targets=r"transformer_blocks\.\d+\.(.*\.)?(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                 r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))",
    joint_text=True,
    vae_stride=(4, 16, 16),  # HunyuanVideo 1.5's VAE: 4x in time (plus the first frame), 16x in height and width
))
