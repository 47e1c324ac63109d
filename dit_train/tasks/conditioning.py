"""Conditioned video training: frames of the clip itself given as context (docs/conditioning.md).

A conditioned sample shows the model some of its own frames and asks it to generate the rest:

    cond.kind=first_frame   the first temporal patch (image-to-video)
    cond.kind=first_last    the first and the last temporal patches (FLF2V)
    cond.kind=prefix        the first cond.prefix_frames frames (continue a video)

A "frame" here is one step of the model's time axis, a temporal patch: model.patch_size[0]
frames of the data (pixel frames, or latent frames on a latent cache). With the tiny pixel DiT
(patch [2, 4, 4]) the first "frame" is the first two pixel frames; with Wan on latents
(patch [1, 2, 2]) it is the first latent frame, which Wan's causal VAE encodes from the first
image alone.

Two ways to feed the context (cond.feed), both as diffusers' Wan models do:

  timestep  (Wan 2.2 TI2V, `expand_timesteps`) the context tokens are given clean (x = x0) with
            timestep 0 per token; they carry loss weight 0 and do not count in T_b.
  concat    (Wan 2.1 I2V) every token stays a noisy target (the model outputs the first frame
            too, as Wan 2.1 I2V trains); the conditioning frames (zeros elsewhere) and a mask
            channel (1 on context frames) are concatenated to the noisy input's channels, in
            diffusers' order [noisy C | mask | conditioning C]; model.cond_channels = C + mask.

Which samples are conditioned (cond.prob) is a pure function of (seed, sample id, step), like
caption dropout, so every layout conditions the same samples. Nothing here communicates.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from dit_train.batch import WEIGHT_ONE
from dit_train.config.cond import companions, cond_active, cond_channels, control_channels
from dit_train.data_pipelines import SOURCES
from dit_train.data_pipelines.companions import KEYS, token_mask_units
from dit_train.models.registry import can_widen
from dit_train.models.wan_experts import pretrained_folder
from dit_train.rng import sample_generator

log = logging.getLogger(__name__)

def context_patch_count(cond: Any, pt: int) -> int:
    """Temporal patches at the start of a clip given as context (the first one for first_frame
    and first_last; cond.prefix_frames / pt for prefix, at least one)."""
    if cond.from_prefix:
        return max(1, cond.prefix_frames // pt)
    return 1


def context_patches(cond: Any, pt: int, num_patches: int) -> torch.Tensor | None:
    """[f] bool: which of a clip's f temporal patches are context. None when no patch would be
    left to generate (a clip too short for its conditioning: it trains unconditioned)."""
    first = context_patch_count(cond, pt)
    last = 1 if cond.gives_last else 0
    if num_patches <= first + last:
        return None
    mask = torch.zeros(num_patches, dtype=torch.bool)
    mask[:first] = True
    if last:
        mask[-1] = True
    return mask


def given_patch_count(cond: Any, pt: int) -> int:
    """Temporal patches a clip gives as context: its first ones, and its last one for first_last."""
    return context_patch_count(cond, pt) + (1 if cond.gives_last else 0)


def too_short(cond: Any, pt: int, frames: list[int]) -> list[int]:
    """Ids of the samples (of `frames[i]` frames each) that leave no temporal patch to generate
    after their context: they train unconditioned (context_patches is None)."""
    return [i for i, f in enumerate(frames) if context_patches(cond, pt, f // pt) is None]


def unconditionable_error(cond: Any, pt: int, frames: list[int], stills: int) -> str:
    """The error when no sample is long enough for `cond` (every one would train unconditioned
    and the run would report completed): the context it takes, the longest sample, and what
    to change. `stills`: how many of the samples are still images."""
    given = given_patch_count(cond, pt) * pt
    longest = max(frames)
    kind = " (all still images)" if stills == len(frames) else ""
    fix = (f"lower cond.prefix_frames to {longest - pt} or less, or train on clips of more than {given} frames"
           if cond.from_prefix and longest > pt else
           f"train on clips of more than {given} frames, or set cond.kind=none")
    return (f"{cond.context_key} gives {given} frames as context, but the longest of the {len(frames)} samples has "
            f"{longest} frames{kind}: no sample leaves a frame to generate, so none would be conditioned (each would "
            f"train unconditioned); {fix}")


def is_conditioned(seed: int, sample_id: int, step: int, prob: float) -> bool:
    """True when sample `sample_id` is conditioned at `step` (probability prob), from the
    "conditioning" stream of (seed, id, step): the same on every layout."""
    if prob >= 1:
        return True
    if prob <= 0:
        return False
    return bool(torch.rand((), generator=sample_generator(seed, sample_id, step, "conditioning")) < prob)


@dataclass
class ClipInputs:
    """What one clip contributes to a pack besides its target.

    x:      [C, F, H, W] the model's input (x_t; with the timestep feed, x0 on context frames)
    weight: [T] int64 loss weight of each token in units of 1/WEIGHT_ONE (0 on context tokens)
    clean:  [T] bool tokens given clean at timestep 0 (timestep feed), else None
    cond:   [C + MASK_CHANNELS, F, H, W] mask and conditioning frames (concat feed), else None
    """

    x: torch.Tensor
    weight: torch.Tensor
    clean: torch.Tensor | None
    cond: torch.Tensor | None


def frame_mask(patches: torch.Tensor | None, pt: int, frames: int) -> torch.Tensor:
    """[F] bool context frames from [f] context temporal patches (None: no context)."""
    if patches is None:
        return torch.zeros(frames, dtype=torch.bool)
    out = patches.repeat_interleave(pt)
    return torch.cat([out, out.new_zeros(frames - out.numel())])[:frames]


def concat_channels(x0: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """[C + 1, F, H, W]: the mask channel (1 on context frames) then x0 on context frames, 0
    elsewhere — the concat feed's extra channels (diffusers' Wan I2V: [mask | condition])."""
    m = frames.to(x0.dtype)[None, :, None, None]
    return torch.cat([m.expand(1, *x0.shape[1:]), x0 * m])


def i2v_mask(frames: torch.Tensor, last: bool, k: int) -> torch.Tensor:
    """[k, F]: diffusers' Wan 2.1 I2V mask channels of a latent clip whose context latent frames
    are `frames` [F] bool (`last`: the last one is the FLF2V last image). Channel j of latent
    frame f is the mask of video frame 4f + j - 3 (k = the VAE's temporal stride 4), the first
    latent frame's one image counted k times, as WanImageToVideoPipeline.prepare_latents folds
    it: the first frame all 1; a last image sets only the last channel of the last frame."""
    m = frames.to(torch.float32)[None].repeat(k, 1)
    if last:
        m[:, -1] = 0
        m[-1, -1] = 1
    return m


def i2v_inputs(xt: torch.Tensor, patches: torch.Tensor | None, last: bool, k: int,
               cond_latents: torch.Tensor | None, patch: tuple[int, int, int]) -> ClipInputs:
    """The inputs of one latent clip [C, F, H, W] in diffusers' Wan 2.1 I2V layout: every token a
    target (weight 1), the extra channels [mask k | condition C] with the condition the cached
    VAE encoding of [first, zeros...] (i2v_cache.py). Unconditioned (patches None): both zero."""
    C, F, H, W = xt.shape
    weight = torch.full((F // patch[0] * (H // patch[1]) * (W // patch[2]),), WEIGHT_ONE, dtype=torch.int64)
    if patches is None:
        return ClipInputs(xt, weight, None, xt.new_zeros(k + C, F, H, W))
    mask = i2v_mask(frame_mask(patches, 1, F), last, k).to(xt.dtype)[:, :, None, None].expand(k, F, H, W)
    return ClipInputs(xt, weight, None, torch.cat([mask, cond_latents.to(xt.dtype)]))


def clip_inputs(x0: torch.Tensor, xt: torch.Tensor, patches: torch.Tensor | None, concat: bool,
                patch: tuple[int, int, int]) -> ClipInputs:
    """The inputs of one clip [C, F, H, W] given its context temporal patches ([f] bool, or
    None when the sample is not conditioned at this step), through the concat feed (`concat`)
    or the timestep feed. Token order is patchify's (t, h, w)."""
    pt, ph, pw = patch
    _, F, H, W = x0.shape
    f, per_patch = F // pt, (H // ph) * (W // pw)
    ctx_tok = (patches if patches is not None else torch.zeros(f, dtype=torch.bool)).repeat_interleave(per_patch)
    frames = frame_mask(patches, pt, F)
    if concat:  # every token stays a target; the context arrives as channels
        weight = torch.full((f * per_patch,), WEIGHT_ONE, dtype=torch.int64)
        return ClipInputs(xt, weight, None, concat_channels(x0, frames))
    x = torch.where(frames[None, :, None, None], x0.to(xt.dtype), xt)  # context frames clean
    weight = torch.where(ctx_tok, 0, WEIGHT_ONE).to(torch.int64)
    return ClipInputs(x, weight, ctx_tok, None)


def masked(weight: torch.Tensor, mask: Any, patch: tuple[int, int, int]) -> torch.Tensor:
    """[T] int64 token weights (units) times the clip's mask made token weights (data.masks; an
    8-bit mask [F, H, W] of pixels, or a latent cache's LatentMask: companions.token_mask_units): w·m / WEIGHT_ONE rounded to the nearest unit in integer arithmetic (exact when
    w is 0 or a whole token, as the conditioning's weights are)."""
    m = token_mask_units(mask, patch)
    return (weight * m + WEIGHT_ONE // 2) // WEIGHT_ONE


class Conditioner:
    """Builds the conditioned inputs of a task's clips (`VideoTask.build` calls `inputs`).

    cond: the CondConfig; patch: the model's (pt, ph, pw); seed: train.seed.
    short: ids of clips too short for their conditioning (trained unconditioned, counted, and
    named once in the log).
    """

    def __init__(self, cond: Any, patch: tuple[int, int, int], seed: int, mask_channels: int = 1):
        self.cond, self.patch, self.seed = cond, tuple(patch), seed
        self.concat = cond.concat_feed
        # > 1: diffusers' Wan 2.1 I2V layout (i2v_inputs), its condition read from the latent cache
        self.i2v = mask_channels if self.concat and mask_channels > 1 else 0
        self.short: set[int] = set()

    def context(self, sample_id: int, step: int, frames: int) -> torch.Tensor | None:
        """[f] bool context temporal patches of a clip of `frames` frames at `step` (None: this
        sample is not conditioned at this step, or its clip is too short)."""
        if not is_conditioned(self.seed, sample_id, step, self.cond.prob):
            return None
        patches = context_patches(self.cond, self.patch[0], frames // self.patch[0])
        if patches is None and sample_id not in self.short:
            self.short.add(sample_id)
            log.warning("sample %d has %d frames: too short for cond.kind=%s (no frame left to generate); it "
                        "trains unconditioned", sample_id, frames, self.cond.kind)
        return patches

    def inputs(self, x0: torch.Tensor, xt: torch.Tensor, sample_id: int, step: int,
               cond_latents: torch.Tensor | None = None) -> ClipInputs:
        """`cond_latents`: the clip's cached I2V condition [C, F, H, W] (the Wan 2.1 I2V layout only)."""
        patches = self.context(sample_id, step, x0.shape[1])
        if self.i2v:
            return i2v_inputs(xt, patches, self.cond.gives_last, self.i2v, cond_latents, self.patch)
        return clip_inputs(x0, xt, patches, self.concat, self.patch)


def vace_context(control: torch.Tensor, inactive: torch.Tensor | None, mask_channels: int) -> torch.Tensor:
    """[2C + k, F, H, W]: Wan VACE's context of a control video [C, F, H, W], as WanVACEPipeline
    builds it for a control video without mask (every pixel to generate: mask 1, so the inactive
    video video·(1 − mask) is all zero and the reactive one video·mask the control itself):
    [inactive C | reactive C | mask k]. `inactive`: the VAE's encoding of the all-zero video on a
    latent run (the cache's control_inactive_latents), None on pixels (zeros); k = the model's
    vace_mask_channels (the VAE's s·s pixels of a latent pixel, 64 for Wan; 1 on pixels)."""
    _, F, H, W = control.shape
    inactive = torch.zeros_like(control) if inactive is None else inactive.to(control.dtype)
    return torch.cat([inactive, control, control.new_ones(mask_channels, F, H, W)])


def vace_data_check(dataset: Any, mask_channels: int) -> None:
    """A latent cache (or latent shards) for Wan VACE: its VAE's s·s pixels per latent pixel must
    be the model's `mask_channels` (WanVACEPipeline's mask layout), and it must hold each clip's
    control_inactive_latents (tools.cache_latents --control writes them); ValueError naming the
    fix otherwise, before the run (the first clip's tensors are read to see)."""
    where = getattr(dataset, "root", "the latent data")
    spatial = int(dataset.meta.get("scale_factor_spatial") or 0)
    if spatial and spatial * spatial != mask_channels:
        raise ValueError(f"model.vace_mask_channels={mask_channels}, but the VAE of {where} folds {spatial} x {spatial} "
                         f"pixels into a latent pixel: set model.vace_mask_channels={spatial * spatial} (VACE's mask "
                         f"channels, WanVACEPipeline.prepare_masks)")
    rows = getattr(dataset, "rows", [])
    if rows and "control_inactive_latents" not in dataset.tensors(rows[0]):
        raise ValueError(f"Wan VACE (model.name=wan_vace) reads each clip's control_inactive_latents (an all-zero video "
                         f"encoded: VACE's inactive video), which {where} was cached without: cache it again with "
                         f"python -m dit_train.tools.cache_latents --control (into a new --out)")


def cond_errors(mode: str, cond: Any, model: Any, data: Any) -> list[str]:
    """One line per problem of the `cond` keys against the mode, model and data (check_config)."""
    e: list[str] = []
    if not 0.0 <= cond.prob <= 1.0:
        e.append(f"cond.prob={cond.prob} must be in [0, 1] (the share of samples conditioned)")
    if cond.prefix_frames < 0:
        e.append(f"cond.prefix_frames={cond.prefix_frames} must be >= 0 (0 = one temporal patch)")
    derived = (cond_channels(cond, getattr(model, "in_channels", 0), getattr(model, "mask_channels", 1), control_channels(model))
               if mode == "video" else 0)
    if getattr(model, "cond_channels", 0) != derived:
        e.append(f"model.cond_channels={model.cond_channels} is derived from cond (cond.kind={cond.kind}, "
                 f"cond.feed={cond.feed} gives {derived}); remove the override")
    e += companion_errors(mode, data, cond)
    if mode == "video":
        e += i2v_errors(cond, model, data)
    rank = getattr(getattr(model, "lora", None), "rank", 0)
    # a family that widens a folder's input (Wan) trains it beside the adapters (models/lora.py)
    if (rank and derived and getattr(model, "pretrained", "") and not can_widen(model)
            and not pretrained_reads_input(model, derived)):
        e.append(f"model.lora.rank={rank} freezes the patch embedding, and the {derived} input channels cond adds to "
                 f"the pretrained one (cond.feed={cond.feed}, cond.control={str(cond.control).lower()}) start at zero: "
                 f"the model would never read them; train without LoRA (model.lora.rank=0)")
    if not cond_active(cond):
        return e
    if mode != "video":
        e.append(f"cond.kind={cond.kind} conditions video clips on their own frames; mode={mode} has none: "
                 f"set cond.kind=none")
        return e
    pt = model.patch_size[0]
    if cond.from_prefix and cond.prefix_frames % pt:
        lower = max(pt, cond.prefix_frames - cond.prefix_frames % pt)
        e.append(f"cond.prefix_frames={cond.prefix_frames} must be a multiple of model.patch_size[0]={pt} (the "
                 f"model's temporal patch): use {lower} or {lower + pt}")
    max_frames = getattr(data, "max_frames", None)
    if max_frames is not None:
        given = given_patch_count(cond, pt)
        if max_frames // pt <= given:
            e.append(f"{cond.context_key} gives {given * pt} frames as context, but clips have at most data.max_frames={max_frames} "
                     f"frames: nothing would be left to generate; raise data.max_frames above {given * pt}"
                     + (" or lower cond.prefix_frames" if cond.from_prefix else ""))
    return e


def pretrained_reads_input(model: Any, derived: int) -> bool:
    """True when model.pretrained's transformer already reads the widened input (its config.json
    in_channels = model.in_channels + the `derived` channels: a Wan 2.1 I2V checkpoint), so LoRA
    freezes a trained patch embedding, not zero-initialised channels; False when it would be
    widened, or cannot be read here (model.pretrained's own check names why)."""
    try:
        config = json.loads((pretrained_folder(model.pretrained, model) / "config.json").read_text())
    except (OSError, ValueError, AttributeError):
        return False
    return config.get("in_channels") == model.in_channels + derived


def i2v_errors(cond: Any, model: Any, data: Any) -> list[str]:
    """The Wan 2.1 I2V layout's config-level needs (model.mask_channels > 1, model.image_dim)."""
    if not hasattr(model, "mask_channels"):  # the layout's keys are Wan's (HunyuanVideo 1.5's image_dim is SigLIP's)
        return []
    k, image_dim = model.mask_channels, getattr(model, "image_dim", 0)
    if k <= 1 and not image_dim:
        return []
    e = []
    if image_dim and k <= 1:
        e.append(f"model.image_dim={image_dim} (the CLIP image branch) is Wan 2.1 I2V's: it needs its input layout, "
                 f"model.mask_channels={model.vae_stride[0]} (model=wan_i2v_tiny / wan_i2v_14b set both)")
    if not (cond.from_images and cond.concat_feed):
        e.append(f"model.mask_channels={k} is diffusers' Wan 2.1 I2V layout: it needs cond.kind=first_frame or "
                 f"first_last with cond.feed=concat (got cond.kind={cond.kind}, cond.feed={cond.feed})")
    source = SOURCES[data.name] if getattr(data, "name", "") in SOURCES else None
    if k > 1 and source is not None and not source.may_be_latent():
        e.append(f"model.mask_channels={k} reads each clip's condition latents from a latent cache written with "
                 f"tools.cache_latents --i2v first_frame (or first_last): use data=latent_cache, or data=shards of latent "
                 f"shards written with --i2v --shards (data={getattr(data, 'name', '')})")
    if k > 1 and (model.patch_size[0] != 1 or k != model.vae_stride[0]):
        e.append(f"model.mask_channels={k} folds the VAE's temporal stride into channels: it needs "
                 f"model.patch_size[0]=1 and model.mask_channels=model.vae_stride[0]={model.vae_stride[0]}")
    return e


def i2v_data_errors(meta: dict, cond: Any, model: Any, where: str) -> list[str]:
    """A latent cache's I2V tensors (meta.json's settings.i2v) against the run's cond and model."""
    i2v = (meta.get("settings") or {}).get("i2v") or {}
    if not i2v:
        return [f"{where} has no I2V condition latents (model.mask_channels={model.mask_channels}): write the cache "
                f"with tools.cache_latents --i2v {cond.kind}" + (" --image-encoder FOLDER" if model.image_dim else "")]
    e = []
    if i2v["kind"] != str(cond.kind):
        e.append(f"{where} holds I2V latents for cond.kind={i2v['kind']}, not cond.kind={cond.kind}: "
                 f"set cond.kind={i2v['kind']} or cache again with --i2v {cond.kind}")
    if model.image_dim and int(i2v.get("image_dim") or 0) != model.image_dim:
        got = int(i2v.get("image_dim") or 0)
        e.append(f"{where} holds {'no image tokens' if not got else f'{got}-wide image tokens'} but model.image_dim="
                 f"{model.image_dim}: " + ("cache with --image-encoder FOLDER" if not got else f"set model.image_dim={got}"))
    return e


def companion_errors(mode: str, data: Any, cond: Any) -> list[str]:
    """One line per companion file (data.masks, cond.control) the mode or data source cannot give."""
    wanted = companions(data, cond)
    if wanted and mode != "video":
        return [f"{' and '.join(f'{KEYS[k]}=true' for k in wanted)} need video clips; mode={mode} has none: "
                f"set {' and '.join(f'{KEYS[k]}=false' for k in wanted)}"]
    name = getattr(data, "name", "")
    source = SOURCES[name] if wanted and name in SOURCES else None
    return [f"{KEYS[k]}=true: data={name} has no {k} files (clips of "
            f"{' or '.join(f'data={n}' for n in SOURCES if k in SOURCES[n].companion_kinds)} can have them: "
            f"docs/conditioning.md); set {KEYS[k]}=false"
            for k in wanted if source is not None and k not in source.companion_kinds]

