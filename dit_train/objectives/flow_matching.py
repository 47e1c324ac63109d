"""Rectified flow: x_t = (1 - t)·x0 + t·ε, the model predicts the velocity v = ε - x0.

t is the noise level (t = 1 pure noise), the same quantity as diffusers' `sigma`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


def sample_timestep_in(gen: torch.Generator, cfg: LossConfig, shift: float, lo: float, hi: float) -> float:
    """t drawn like `shift_timestep(sample_timestep(...), shift)` but conditioned on lo <= t <= hi,
    by the inverse CDF (one uniform draw, no rejection loop): the distribution keeps its shape
    inside the range (what rescaling a whole-range draw onto it would not: a shift-12 draw
    squeezed into [0, 0.875] piles up near 0.875).

    The shift is increasing, so t in [lo, hi] <=> the unshifted u in [u(lo), u(hi)], u(t) =
    t / (s − (s − 1)·t); u = F⁻¹(F(u_lo) + p·(F(u_hi) − F(u_lo))), F the CDF of the draw
    (uniform: u itself; logit-normal: Φ((logit u − mean) / std)).
    """
    p = float(torch.rand((), generator=gen))
    u_lo, u_hi = (x / (shift - (shift - 1) * x) for x in (lo, hi))
    if cfg.timestep_sampling == "uniform":
        return shift_timestep(u_lo + p * (u_hi - u_lo), shift)
    if cfg.timestep_sampling != "logit_normal":
        raise ValueError(f"loss.timestep_sampling={cfg.timestep_sampling!r} must be logit_normal or uniform")

    def cdf(u: float) -> float:
        if u <= 0.0 or u >= 1.0:
            return 0.0 if u <= 0.0 else 1.0
        z = (math.log(u / (1 - u)) - cfg.logit_mean) / cfg.logit_std
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    q = cdf(u_lo) + p * (cdf(u_hi) - cdf(u_lo))
    z = float(torch.special.ndtri(torch.tensor(q, dtype=torch.float64))) * cfg.logit_std + cfg.logit_mean
    return min(max(shift_timestep(1 / (1 + math.exp(-z)), shift), lo), hi)  # float rounding stays inside


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


@dataclass(frozen=True)
class PipelineShift:
    """A diffusers pipeline's token-count-dependent schedule (LTXPipeline, Flux): the sigmas
    linspace(1, 1/n, n) shifted by s = e^mu with mu linear in the clip's token count, from
    base_shift at base_seq_len to max_shift at max_seq_len (diffusers' `calculate_shift`), then
    stretched so that the last one is shift_terminal (0 = not stretched): the
    FlowMatchEulerDiscreteScheduler config keys of the same names (use_dynamic_shifting)."""

    base_shift: float
    max_shift: float
    base_seq_len: int
    max_seq_len: int
    shift_terminal: float = 0.0

    def mu(self, tokens: int) -> float:
        """diffusers' calculate_shift(tokens, base_seq_len, max_seq_len, base_shift, max_shift)."""
        m = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return tokens * m + self.base_shift - m * self.base_seq_len

    def scheduler_config(self) -> dict:
        """FlowMatchEulerDiscreteScheduler(**this) computes the schedule from set_timesteps(sigmas, mu)."""
        return dict(use_dynamic_shifting=True, base_shift=self.base_shift, max_shift=self.max_shift,
                    base_image_seq_len=self.base_seq_len, max_image_seq_len=self.max_seq_len,
                    shift_terminal=self.shift_terminal or None)


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
                 shift: float = 1.0, t_range: tuple[float, float] = (0.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(x_t, velocity target, t) for one sample; noise and t depend only on (seed, id, step).
    t is drawn by `cfg.timestep_sampling`, then shifted by `shift` (see `sample_shift`); with a
    `t_range` other than (0, 1) (a Wan 2.2 A14B expert's side of the boundary,
    models/wan_experts.py) from that distribution conditioned on lo <= t <= hi
    (`sample_timestep_in`)."""
    gen = sample_generator(seed, sample_id, step, "timestep")
    if tuple(t_range) != (0.0, 1.0):
        t = sample_timestep_in(gen, cfg, shift, *t_range)
    else:
        t = shift_timestep(sample_timestep(gen, cfg), shift)
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


def per_token_mse(pred: torch.Tensor, target: torch.Tensor, width: torch.Tensor | None = None) -> torch.Tensor:
    """[L, D], [L, D] -> [L] mean squared error of each token (fp32). width: [L] the features of
    each token's own stream when the rows are zero-padded to the widest stream (audio + video:
    tasks/joint_audio.py), so that a token's error is the mean over its own features, never
    diluted by the other stream's padding; None = all D."""
    sq = (pred.float() - target.float()).pow(2)
    return sq.mean(dim=-1) if width is None else sq.sum(dim=-1) / width.to(sq.device, sq.dtype)
