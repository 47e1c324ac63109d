"""DMD2's maths for flow matching (Yin et al. 2024, "Improved Distribution Matching
Distillation"), as pure functions of tensors; docs/distillation.md derives them.

Notation: x_t = (1 − t)·x0 + t·ε, v = ε − x0, so a velocity v at x_t stands for
x̂0 = x_t − t·v. Tokens are [L, D] (D values per patch), per-sample scalars are indexed by
each token's `seg` (padding tokens, seg −1, pick an appended neutral value).
"""
from __future__ import annotations

import torch

from dit_train.objectives.flow_matching import shift_timestep


def student_sigmas(steps: int, shift: float) -> list[float]:
    """The student's noise levels σ_0 = 1 > … > σ_{K−1} > σ_K = 0 for K = `steps`: the Euler
    sampler's grid for that many steps (sampling/sampler.py: diffusers' shift-1 grid, then the
    sample's shift), so `tools.sample --steps K` walks exactly the levels the student trained at."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # deferred: ~2 s to import

    plain = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    plain.set_timesteps(steps)
    grid = torch.tensor(plain.sigmas[:-1].tolist(), dtype=torch.float64)
    return [float(s) for s in shift_timestep(grid, shift)] + [0.0]


def per_token(values: torch.Tensor, seg: torch.Tensor, pad: float = 1.0) -> torch.Tensor:
    """[S] per-sample values -> [L, 1] each token's (padding tokens get `pad`)."""
    v = torch.cat([values.float(), values.new_full((1,), pad, dtype=torch.float32)]).to(seg.device)
    return v[seg][:, None]


def x0_from_velocity(x_t: torch.Tensor, v: torch.Tensor, t_tok: torch.Tensor) -> torch.Tensor:
    """x̂0 = x_t − t·v ([L, D]; t_tok [L, 1])."""
    return x_t - t_tok * v


def guided(v_cond: torch.Tensor, v_uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Classifier-free guidance v_u + g·(v_c − v_u) (v_c itself when g = 1 or no uncond)."""
    if v_uncond is None or scale == 1.0:
        return v_cond
    return v_uncond + scale * (v_cond - v_uncond)


def dmd_direction(fake_minus_real: torch.Tensor, normaliser_tok: torch.Tensor) -> torch.Tensor:
    """DMD's gradient of the generator's sample: (x0_fake − x0_real) / mean|x̂0 − x0_real| of
    the sample ([L, D]; normaliser_tok [L, 1], the whole sample's mean, synced across ranks).
    NaN/inf (a sample whose normaliser is 0) become 0, as in DMD2's code."""
    return torch.nan_to_num(fake_minus_real / normaliser_tok)


def dmd_token_loss(x0_hat: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """[L] 0.5·mean_D |x̂0 − sg(x̂0 − grad)|² per token: its gradient in x̂0 is grad / D, its value
    0.5·mean_D grad²."""
    target = (x0_hat.detach() - direction).detach()
    return 0.5 * (x0_hat.float() - target.float()).pow(2).mean(dim=-1)
