"""Diffusion forcing (Chen et al. 2024; SkyReels-V2): each causal block of a clip at its own noise
level, loss.frame_noise=block.

A clip of F frames in blocks of K frames (model.causal_block_frames) has nb = ceil(F / K) blocks;
block j draws t_j, and its frames are x_t = (1 − t_j)·x0 + t_j·ε with the clip's one ε. The target
is the velocity ε − x0 as always. Every draw comes from the clip's own generator (seed, sample
id, step): the same noise levels whatever rank or pack holds the clip. History blocks (the first h,
loss.history_prob) are given clean (t = 0) and carry weight 0, so they are context only and out
of T_b. Nothing here communicates.
"""
from __future__ import annotations

import math

import torch

from dit_train.config import LossConfig
from dit_train.objectives.flow_matching import sample_timestep, shift_timestep
from dit_train.rng import sample_generator


def block_timesteps(seed: int, sample_id: int, step: int, cfg: LossConfig, shift: float,
                    blocks: int) -> tuple[torch.Tensor, int]:
    """([blocks] float64 t of each block, h: leading clean history blocks, whose t is 0).

    t_j: drawn as a clip's t (`loss.timestep_sampling`, then the sample's shift), one draw per
    block in time order; `nondecreasing` sorts them (later blocks at least as noisy). Then one
    uniform decides history (probability loss.history_prob, only with 2+ blocks: one block
    must stay supervised) and h is uniform in 1..blocks−1. The same number of draws is taken
    whatever the outcome, so a setting never shifts another's random stream."""
    gen = sample_generator(seed, sample_id, step, "block_timestep")
    t = torch.tensor([shift_timestep(sample_timestep(gen, cfg), shift) for _ in range(blocks)], dtype=torch.float64)
    if cfg.block_noise_schedule == "nondecreasing":
        t = t.sort().values
    has_history = float(torch.rand((), generator=gen)) < cfg.history_prob
    h = int(torch.randint(1, max(blocks, 2), (), generator=gen))
    if not (has_history and blocks >= 2):
        return t, 0
    t[:h] = 0.0
    return t, h


def noisy_blocks(x0: torch.Tensor, seed: int, sample_id: int, step: int, cfg: LossConfig, shift: float,
                 block_frames: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x_t [C, F, H, W], velocity target [C, F, H, W], t [nb] float64, h) of one clip x0
    [C, F, H, W] in blocks of `block_frames` frames (the last may be shorter); the noise ε is
    the stream `noise` of flow_matching.noisy_sample, so one clip's ε is the same under either
    loss.frame_noise."""
    frames = x0.shape[1]
    t, h = block_timesteps(seed, sample_id, step, cfg, shift, math.ceil(frames / block_frames))
    t_frame = t.repeat_interleave(block_frames)[:frames].to(x0.dtype).view(1, frames, 1, 1)
    eps = torch.randn(x0.shape, generator=sample_generator(seed, sample_id, step, "noise")).to(x0)
    return (1.0 - t_frame) * x0 + t_frame * eps, eps - x0, t, h


def history_weights(temporal_patches: int, slab_tokens: int, causal_block: int, history: int,
                    weight_one: int) -> torch.Tensor:
    """[T] int64 loss weight units of a clip's T = temporal_patches·slab_tokens tokens (patchify's
    order: temporal patch outermost): 0 on the tokens of its first `history` blocks of
    `causal_block` temporal patches (clean context, outside T_b), `weight_one` elsewhere."""
    units = torch.full((temporal_patches * slab_tokens,), weight_one, dtype=torch.int64)
    units[: min(history * causal_block, temporal_patches) * slab_tokens] = 0
    return units
