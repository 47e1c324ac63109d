"""Video rollouts of a session: clips sampled from captions, and for Flow-GRPO the SDE sampler's
trajectory with the log-probability of every transition.

The SDE is Flow-GRPO's (Liu et al. 2025, "Flow-GRPO", eq. 9): from the flow ODE dx = v dt, the
reverse-time SDE with the same marginals, discretized on the sampler's σ grid
(σ_k decreasing from 1 to 0; Δ = σ_{k+1} − σ_k < 0):

    s_k  = η·sqrt(σ_k / (1 − σ_k))                       (σ_k = 1 uses σ_1 in the denominator)
    μ_k  = x_k·(1 + s_k²·Δ/(2σ_k)) + v(x_k, σ_k)·(1 + s_k²·(1 − σ_k)/(2σ_k))·Δ
    x_{k+1} = μ_k + s_k·sqrt(−Δ)·ε_k

so the transition x_k → x_{k+1} is Gaussian N(μ_k, (s_k·sqrt(−Δ))²) per element, with a
log-probability the policy gradient can differentiate through v. ε_k comes from the clip's own
"sampling" stream of (seed, noise id, k + 1) (the start x_0 from step 0), as validation's
stochastic sampler draws it: rollouts do not depend on the rank or the layout. Rank 0's rollouts
are broadcast, so every rank holds the very same tensors.

`transition_logprob` is the one formula both the sampler (the old log-probs) and the loss (the
policy's) use: the mean over the clip's elements of log N(x_{k+1}; μ_k, std²).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from dit_train.config import to_yaml
from dit_train.objectives.flow_matching import velocity_from_output
from dit_train.rng import sample_generator
from dit_train.sampling.sampler import VideoSampler, predict_velocity
from dit_train.tasks.video import unpatchify

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


# -- the SDE transition: pure functions ---------------------------------------------------------


def sde_std(sigma: float, sigma_next: float, sigma_first_below_one: float, eta: float) -> tuple[float, float]:
    """(s_k, std of the transition s_k·sqrt(−Δ)) of the step σ → σ_next (floats)."""
    denom = 1.0 - (sigma_first_below_one if sigma >= 1.0 else sigma)
    s = eta * math.sqrt(sigma / denom)
    return s, s * math.sqrt(sigma - sigma_next)


def sde_mean(x: torch.Tensor, v: torch.Tensor, sigma: Any, sigma_next: Any, s: Any) -> torch.Tensor:
    """μ of the transition (elementwise; sigma, sigma_next, s: floats or tensors broadcasting to x)."""
    dt = sigma_next - sigma
    return x * (1 + s ** 2 * dt / (2 * sigma)) + v * (1 + s ** 2 * (1 - sigma) / (2 * sigma)) * dt


def gaussian_logpdf(x: torch.Tensor, mean: torch.Tensor, std: Any) -> torch.Tensor:
    """Elementwise log N(x; mean, std²) (std: float or a tensor broadcasting to x)."""
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device)
    return -((x - mean) ** 2) / (2 * std ** 2) - torch.log(std) - HALF_LOG_2PI


def transition_logprob(next_x: torch.Tensor, mean: torch.Tensor, std: float) -> float:
    """Mean over all elements of log N(next_x; mean, std²): a transition's log-probability
    (Flow-GRPO's per-element mean, so ratios stay O(1) whatever the clip's size)."""
    return float(gaussian_logpdf(next_x.double(), mean.double(), std).mean())


# -- rollouts ----------------------------------------------------------------------------------------


@dataclass
class VideoRollout:
    """One sampled clip.

    caption: its caption; noise_id: its noise stream; clip: [C, F, H, W] in model space (pixels
    in [-1, 1] for pixel runs); run: the id of the run that sampled it (`run_id`).
    With sde=True also: latents [K+1] of [C, F, H, W] (x_0 = noise ... x_K = clip), sigmas [K+1]
    (σ_k of x_k), stds [K] (each transition's std), log_probs [K] (mean log-prob per element of
    each transition under the sampling weights: the old log-probs of Flow-GRPO).
    """

    caption: str
    noise_id: int
    clip: torch.Tensor
    run: str
    latents: list[torch.Tensor] = field(default_factory=list)
    sigmas: list[float] = field(default_factory=list)
    stds: list[float] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


def run_id(cfg: Any) -> str:
    """An id of the run a session belongs to: its model, data and seed (not the layout), so a
    rollout of another run — another model or world — is recognised."""
    text = to_yaml(cfg.model) + to_yaml(cfg.data) + f"seed={cfg.train.seed}"
    return f"{zlib.crc32(text.encode()):08x}"


class SDESampler(VideoSampler):
    """VideoSampler with Flow-GRPO's SDE step, recording the trajectory (module docstring).
    Classifier-free guidance is applied as in VideoSampler when guidance_scale > 1 (the
    recorded log-probs are then those of the guided policy)."""

    def __init__(self, *args: Any, eta: float = 0.7, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.eta = eta

    @torch.no_grad()
    def trajectories(self, model: torch.nn.Module, autocast: Callable[[], Any]) -> list[dict[str, list]]:
        """Per request: {"latents": [K+1], "sigmas": [K+1], "stds": [K], "log_probs": [K]}."""
        xs, cfg, ctxs = self._start()
        sigmas = [s.sigmas.tolist() for s in self.schedulers()]
        n = len(xs)
        out = [{"latents": [x.clone()], "sigmas": [sig[0]], "stds": [], "log_probs": []} for x, sig in zip(xs, sigmas)]
        sizes = [math.prod(self._grid(x.shape)) for x in xs]
        offsets = torch.tensor([0] + (sizes + sizes if cfg else sizes)).cumsum(0).tolist()
        was_training = model.training
        model.eval()
        for i in range(self.steps):
            ts = [sig[i] for sig in sigmas]
            none = [None] * (2 * n if cfg else n)  # no given frames, no control: conditioned runs are refused
            batch = self._pack(xs + xs if cfg else xs, ts + ts if cfg else ts, ctxs, none, none)
            with autocast():
                v = predict_velocity(model, batch, self.ctx).cpu()
            t_tok = batch.samples["t"][batch.seg.clamp_min(0)]
            v = velocity_from_output(v, batch.tokens["x"], t_tok, self.prediction, self.x0_min_t)
            for k in range(n):
                vk = v[offsets[k]:offsets[k + 1]]
                if cfg:
                    vu = v[offsets[n + k]:offsets[n + k + 1]]
                    vk = vu + self.guidance * (vk - vu)
                vel = unpatchify(vk, self._grid(xs[k].shape), self.patch, xs[k].shape[0])
                sig, nxt = sigmas[k][i], sigmas[k][i + 1]
                s, std = sde_std(sig, nxt, sigmas[k][1], self.eta)
                mean = sde_mean(xs[k], vel, sig, nxt, s)
                eps = torch.randn(mean.shape, generator=sample_generator(self.seed, self.requests[k].noise_id, i + 1,
                                                                          "sampling"))
                xs[k] = mean + std * eps
                rec = out[k]
                rec["latents"].append(xs[k].clone())
                rec["sigmas"].append(nxt)
                rec["stds"].append(std)
                rec["log_probs"].append(transition_logprob(xs[k], mean, std))
        model.train(was_training)
        return out


def broadcast_from_rank0(value: Any, group: Any, is_main: bool) -> Any:
    """Rank 0's value on every rank (identical tensors whatever each rank computed)."""
    if group is None:
        return value
    box = [value if is_main else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-4) -> list[float]:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation
    (+eps). Groups are consecutive runs of `group_size` rewards (the samples of one caption)."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    std = r.std(dim=1, unbiased=False, keepdim=True) if group_size > 1 else torch.zeros_like(r)
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).view(-1).tolist()
