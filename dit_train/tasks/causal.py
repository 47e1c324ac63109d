"""Block-causal video's rules on clip lengths and on the keys that go with it (docs/causal.md).

A causal block holds K = model.causal_block_frames frames. A clip whose length is not a multiple
of K would end in a short block that the streaming sampler never produces (it generates whole
blocks), so:

- a configured clip length that is fixed (data.max_frames of the pixel sources, a synthetic
  source whose clips all have one length) and is not a multiple of K is refused before the run
  starts, with the values that would work (`causal_errors`);
- variable-length data is trimmed: each clip keeps its first `kept_frames(F, K)` frames (whole
  blocks), and the frames dropped are counted and reported before step 0 (`trim_report`). A clip
  shorter than one block (a still image: one temporal patch) is kept whole, as one block.

Nothing here communicates.
"""
from __future__ import annotations

from typing import Any

from dit_train.config.cond import cond_active


def kept_frames(frames: int, block_frames: int) -> int:
    """Frames a clip of `frames` trains with under blocks of `block_frames` frames (0 = not
    causal: all): cut down to whole blocks, or kept whole when shorter than one block."""
    if block_frames <= 0 or frames < block_frames:
        return frames
    return frames - frames % block_frames


def fixed_frames(data: Any, pt: int) -> tuple[str, int] | None:
    """(the key that fixes it, frames) when every clip of the data has the same configured frame
    count, cut to the temporal patch as the readers do; None for variable lengths. The pixel
    sources' data.max_frames caps every clip, so a cap off the block grid trims every long clip."""
    max_frames = getattr(data, "max_frames", None)
    frames = getattr(data, "frames", None)  # synthetic_video: [min, max] frames generated
    if frames is not None and max_frames is not None and min(frames[0], max_frames) == min(frames[1], max_frames):
        n = min(frames[0], max_frames)
        key = f"data.frames={list(frames)}" if n == frames[0] else f"data.max_frames={max_frames}"
        return key, n - n % pt
    if max_frames is not None:
        return f"data.max_frames={max_frames}", max_frames - max_frames % pt
    return None


def causal_errors(mode: str, model: Any, data: Any, loss: Any, cond: Any) -> list[str]:
    """One line per problem of block-causal training's keys (check_config): the configured clip
    length against the block, and diffusion forcing's keys."""
    if mode != "video":
        return []
    e: list[str] = []
    k = getattr(model, "causal_block_frames", 0)
    block = loss.frame_noise == "block"
    if not 0.0 <= loss.history_prob <= 1.0:
        e.append(f"loss.history_prob={loss.history_prob} must be in [0, 1] (the share of clips given clean history blocks)")
    if block and k <= 0:
        e.append("loss.frame_noise=block draws one noise level per causal block, but the model has none: set "
                 "model.causal_block_frames (e.g. 4, model=dit_*) or loss.frame_noise=clip")
    elif not block and (loss.history_prob > 0 or loss.block_noise_schedule != "independent"):
        e.append(f"loss.history_prob={loss.history_prob} and loss.block_noise_schedule={loss.block_noise_schedule} shape "
                 f"per-block noise: set loss.frame_noise=block (diffusion forcing) or leave them at 0 / independent")
    if block and cond_active(cond):
        e.append(f"loss.frame_noise=block with cond.kind={cond.kind}: diffusion forcing's clean history blocks are its "
                 f"conditioning; set cond.kind=none (and loss.history_prob for context blocks)")
    if k <= 0 or k % model.patch_size[0]:
        return e  # not causal, or the model's own check reports the block
    fixed = fixed_frames(data, model.patch_size[0])
    if fixed is not None and fixed[1] >= k and fixed[1] % k:
        key, n = fixed
        lower, upper = n - n % k, n - n % k + k
        fix = (f"data.frames=[{lower}, {lower}] or [{upper}, {upper}]" if key.startswith("data.frames")
               else f"data.max_frames={lower} or {upper}")
        e.append(f"{key} gives clips of {n} frames, not a multiple of model.causal_block_frames={k}: every such clip "
                 f"would lose its last {n % k} frames (causal blocks are whole); use {fix}, or a "
                 f"model.causal_block_frames that divides {n}")
    return e


def trim_report(frame_counts: list[int], block_frames: int) -> str | None:
    """A warning line for the clips that variable-length data trims to whole blocks (count and
    frames dropped), None when none is trimmed."""
    trimmed = [f for f in frame_counts if kept_frames(f, block_frames) != f]
    if not trimmed:
        return None
    dropped = sum(f - kept_frames(f, block_frames) for f in trimmed)
    return (f"model.causal_block_frames={block_frames}: {len(trimmed)} of the {len(frame_counts)} clips are not a "
            f"multiple of {block_frames} frames; they train with their first whole blocks ({dropped} frames trimmed "
            f"in all, the last {max(f % block_frames for f in trimmed)} or fewer of each)")
