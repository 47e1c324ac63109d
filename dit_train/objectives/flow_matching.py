"""Rectified flow: x_t = (1 - t)·x0 + t·ε, the model predicts the velocity v = ε - x0.

t is the noise level (t = 1 pure noise), the same quantity as diffusers' `sigma`.
"""
from __future__ import annotations

import math

import torch

from dit_train.config import LossConfig
from dit_train.rng import sample_generator


def sample_timestep(gen: torch.Generator, cfg: LossConfig) -> float:
    """t ∈ (0, 1): logit-normal (SD3's default, more weight mid-trajectory) or uniform."""
    if cfg.timestep_sampling == "logit_normal":
        z = torch.randn((), generator=gen) * cfg.logit_std + cfg.logit_mean
        return float(torch.sigmoid(z))
    if cfg.timestep_sampling == "uniform":
        return float(torch.rand((), generator=gen))
    raise ValueError(f"loss.timestep_sampling={cfg.timestep_sampling!r} must be logit_normal or uniform")


def shift_timestep(t, s: float):
    """t' = s·t / (1 + (s − 1)·t): SD3's and Wan's timestep shift (float or tensor t ∈ [0, 1]).

    The same map as diffusers' `FlowMatchEulerDiscreteScheduler(shift=s)` applies to its sigmas
    (our t is its sigma), so training and sampling agree. It is increasing, fixes 0 and 1, and
    for s > 1 moves every t towards 1: more of the training (and of the sampling steps) at high
    noise. In SNR terms it divides the signal-to-noise ratio ((1 − t)/t)² by s². s = 1 is the
    identity bit for bit (1·t / (1 + 0·t) = t in IEEE arithmetic).
    """
    return s * t / (1 + (s - 1) * t)


def sample_shift(shift: float, reference_tokens: int, tokens: int) -> float:
    """The shift of one sample of `tokens` patches (T_b): `shift` alone when reference_tokens = 0,
    else shift·sqrt(T_b / reference_tokens).

    The resolution-dependent rule of SD3 (Esser et al. 2024, "Scaling Rectified Flow
    Transformers", §5.3.2): a sample with n times as many values needs a shift of sqrt(n) to
    keep the same noise-to-signal balance; for video T_b counts frames × height × width
    patches. A function of the sample alone (never of the pack or the layout), so exactness
    holds, and the sampler gives every clip the shift of its own size.
    """
    return shift * math.sqrt(tokens / reference_tokens) if reference_tokens > 0 else shift


def loss_weight(t: torch.Tensor, scheme: str) -> torch.Tensor:
    """[S] weight w(t_b) of each sample's per-token loss (float32), diffusers'
    `compute_loss_weighting_for_sd3` with our t as sigma:

        none        1
        sigma_sqrt  1 / t²                      (grows without bound as t -> 0)
        cosmap      2 / (π·(1 − 2t + 2t²))      (SD3's CosMap)
    """
    t = t.float()
    if scheme == "none":
        return torch.ones_like(t)
    if scheme == "sigma_sqrt":
        return t ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * t + 2 * t ** 2))
    raise ValueError(f"loss.weighting={scheme!r} must be none, sigma_sqrt or cosmap")


def noisy_sample(x0: torch.Tensor, seed: int, sample_id: int, step: int, cfg: LossConfig,
                 shift: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(x_t, velocity target, t) for one sample; noise and t depend only on (seed, id, step).
    t is drawn by `cfg.timestep_sampling`, then shifted by `shift` (see `sample_shift`)."""
    t = shift_timestep(sample_timestep(sample_generator(seed, sample_id, step, "timestep"), cfg), shift)
    eps = torch.randn(x0.shape, generator=sample_generator(seed, sample_id, step, "noise")).to(x0)
    return (1.0 - t) * x0 + t * eps, eps - x0, t


def per_token_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[L, D], [L, D] -> [L] mean squared error of each token (fp32)."""
    return (pred.float() - target.float()).pow(2).mean(dim=-1)
