"""Rectified flow: x_t = (1 - t)·x0 + t·ε, the model predicts the velocity v = ε - x0."""
from __future__ import annotations

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


def noisy_sample(x0: torch.Tensor, seed: int, sample_id: int, step: int, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(x_t, velocity target, t) for one sample; noise and t depend only on (seed, id, step)."""
    t = sample_timestep(sample_generator(seed, sample_id, step, "timestep"), cfg)
    eps = torch.randn(x0.shape, generator=sample_generator(seed, sample_id, step, "noise")).to(x0)
    return (1.0 - t) * x0 + t * eps, eps - x0, t


def velocity_from_output(out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float, prediction: str,
                         min_t: float = 0.05) -> torch.Tensor:
    """The velocity that a model output stands for ([L, D] tokens; t: per-token [L] or a float).

    prediction "velocity": the output itself; "x0": the output is x̂0 and v = (x_t − x̂0) / t,
    with t clamped below at `min_t` (x_t = (1 − t)·x0 + t·ε gives ε − x0 = (x_t − x0) / t)."""
    if prediction == "velocity":
        return out
    if prediction != "x0":
        raise ValueError(f"model.prediction={prediction!r} must be velocity or x0")
    if isinstance(t, torch.Tensor):
        t = t.to(out.device, torch.float32).clamp_min(min_t)[:, None]
    else:
        t = max(float(t), min_t)
    return (x_t.to(out.dtype) - out) / t


def per_token_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[L, D], [L, D] -> [L] mean squared error of each token (fp32)."""
    return (pred.float() - target.float()).pow(2).mean(dim=-1)
