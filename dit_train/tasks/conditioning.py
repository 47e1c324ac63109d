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

import logging
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange

from dit_train.batch import WEIGHT_ONE
from dit_train.config.schema import cond_active, cond_channels
from dit_train.rng import sample_generator

log = logging.getLogger(__name__)

def context_patch_count(cond: Any, pt: int) -> int:
    """Temporal patches at the start of a clip given as context (the first one for first_frame
    and first_last; cond.prefix_frames / pt for prefix, at least one)."""
    if str(cond.kind) == "prefix":
        return max(1, cond.prefix_frames // pt)
    return 1


def context_patches(cond: Any, pt: int, num_patches: int) -> torch.Tensor | None:
    """[f] bool: which of a clip's f temporal patches are context. None when no patch would be
    left to generate (a clip too short for its conditioning: it trains unconditioned)."""
    first = context_patch_count(cond, pt)
    last = 1 if str(cond.kind) == "first_last" else 0
    if num_patches <= first + last:
        return None
    mask = torch.zeros(num_patches, dtype=torch.bool)
    mask[:first] = True
    if last:
        mask[-1] = True
    return mask


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


def clip_inputs(x0: torch.Tensor, xt: torch.Tensor, patches: torch.Tensor | None, feed: str,
                patch: tuple[int, int, int]) -> ClipInputs:
    """The inputs of one clip [C, F, H, W] given its context temporal patches ([f] bool, or
    None when the sample is not conditioned at this step). Token order is patchify's (t, h, w)."""
    pt, ph, pw = patch
    _, F, H, W = x0.shape
    f, per_patch = F // pt, (H // ph) * (W // pw)
    ctx_tok = (patches if patches is not None else torch.zeros(f, dtype=torch.bool)).repeat_interleave(per_patch)
    frames = frame_mask(patches, pt, F)
    if feed == "concat":  # every token stays a target; the context arrives as channels
        weight = torch.full((f * per_patch,), WEIGHT_ONE, dtype=torch.int64)
        return ClipInputs(xt, weight, None, concat_channels(x0, frames))
    x = torch.where(frames[None, :, None, None], x0.to(xt.dtype), xt)  # context frames clean
    weight = torch.where(ctx_tok, 0, WEIGHT_ONE).to(torch.int64)
    return ClipInputs(x, weight, ctx_tok, None)


def mask_weight_units(mask: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """An 8-bit mask [F, H, W] (uint8, 255 = fully supervised) -> [T] int64 token weights in
    units of 1/WEIGHT_ONE: each token's mean mask value over its patch, k/255 = 257·k units,
    rounded to the nearest unit in integer arithmetic (exact, the same on every machine)."""
    pt, ph, pw = patch
    F, H, W = mask.shape
    f, h, w = F // pt, H // ph, W // pw
    m = mask[: f * pt, : h * ph, : w * pw].to(torch.int64) * (WEIGHT_ONE // 255)
    sums = rearrange(m, "(f pt) (h ph) (w pw) -> (f h w) (pt ph pw)", pt=pt, ph=ph, pw=pw).sum(-1)
    n = pt * ph * pw
    return (2 * sums + n) // (2 * n)


class Conditioner:
    """Builds the conditioned inputs of a task's clips (`VideoTask.build` calls `inputs`).

    cond: the CondConfig; patch: the model's (pt, ph, pw); seed: train.seed.
    short: ids of clips too short for their conditioning (trained unconditioned, counted, and
    named once in the log).
    """

    def __init__(self, cond: Any, patch: tuple[int, int, int], seed: int):
        self.cond, self.patch, self.seed = cond, tuple(patch), seed
        self.feed = str(cond.feed)
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

    def inputs(self, x0: torch.Tensor, xt: torch.Tensor, sample_id: int, step: int) -> ClipInputs:
        return clip_inputs(x0, xt, self.context(sample_id, step, x0.shape[1]), self.feed, self.patch)


def input_tokens(batch: Any) -> torch.Tensor:
    """[L, in] the model's input tokens of a pack: x, with the concat feed's channels appended
    per token (patchify flattens channels outermost, so appending features per token is the
    channel concatenation [noisy | mask | conditioning] of the patch)."""
    x = batch.tokens["x"]
    cond = batch.tokens.get("cond")
    return x if cond is None else torch.cat([x, cond.to(x.dtype)], dim=-1)


def cond_errors(mode: str, cond: Any, model: Any, data: Any) -> list[str]:
    """One line per problem of the `cond` keys against the mode, model and data (check_config)."""
    e: list[str] = []
    if not 0.0 <= cond.prob <= 1.0:
        e.append(f"cond.prob={cond.prob} must be in [0, 1] (the share of samples conditioned)")
    if cond.prefix_frames < 0:
        e.append(f"cond.prefix_frames={cond.prefix_frames} must be >= 0 (0 = one temporal patch)")
    derived = cond_channels(cond, getattr(model, "in_channels", 0)) if mode == "video" else 0
    if getattr(model, "cond_channels", 0) != derived:
        e.append(f"model.cond_channels={model.cond_channels} is derived from cond (cond.kind={cond.kind}, "
                 f"cond.feed={cond.feed} gives {derived}); remove the override")
    if not cond_active(cond):
        return e
    if mode != "video":
        e.append(f"cond.kind={cond.kind} conditions video clips on their own frames; mode={mode} has none: "
                 f"set cond.kind=none")
        return e
    pt = model.patch_size[0]
    if str(cond.kind) == "prefix" and cond.prefix_frames % pt:
        lower = max(pt, cond.prefix_frames - cond.prefix_frames % pt)
        e.append(f"cond.prefix_frames={cond.prefix_frames} must be a multiple of model.patch_size[0]={pt} (the "
                 f"model's temporal patch): use {lower} or {lower + pt}")
    max_frames = getattr(data, "max_frames", None)
    if max_frames is not None:
        given = context_patch_count(cond, pt) + (1 if str(cond.kind) == "first_last" else 0)
        if max_frames // pt <= given:
            what = f"cond.prefix_frames={cond.prefix_frames}" if str(cond.kind) == "prefix" else f"cond.kind={cond.kind}"
            e.append(f"{what} gives {given * pt} frames as context, but clips have at most data.max_frames={max_frames} "
                     f"frames: nothing would be left to generate; raise data.max_frames above {given * pt}"
                     + (" or lower cond.prefix_frames" if str(cond.kind) == "prefix" else ""))
    return e
