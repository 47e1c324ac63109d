"""Reward losses of video generators (mode=video): DiffusionNFT, Flow-GRPO, Diffusion-DPO.

Like losses.py, each is a pure per-token function plus an aggregation; the session
back-propagates Σ_t a_t·l_t and `optim_step` divides by the step's counts.

diffusion_nft_loss (Zheng et al. 2025, "DiffusionNFT"), per token of a clip with reward
    weight r = 1/2 + 1/2·clip(A / adv_clip, −1, 1) and target velocity u (the clip's own noise):
        v⁺ = (1 − β)·v_old + β·v_θ,   v⁻ = (1 + β)·v_old − β·v_θ
        l_t = r·|v⁺ − u|² + (1 − r)·|v⁻ − u|²      (|·|² = mean over the token's values)
    v_old: the old policy's velocity (a VideoDatum's `old_velocity`: the weights the rollouts
    were sampled with, e.g. an EMA of the policy), else v_θ detached (on-policy). The gradient is
    2β·((2r − 1)·(v_old − u) + β·(v_θ − v_old))·∂v_θ: the second term pulls v_θ back to v_old, the
    proximal term of DiffusionNFT; with v_old = v_θ it vanishes, leaving β·(2r − 1)·∇|v_θ − u|²,
    whose group sum has no restoring force (measured: a drift, docs/video-rl.md).
    Token-level: agg "token" + "num_loss_tokens", or agg "sequence" + "num_sequences" (clips).

flow_grpo_loss (Liu et al. 2025, "Flow-GRPO"), per transition b = (clip, step k) of an SDE
    rollout: π_b = the transition's log-probability under the current weights (mean over its
    elements of log N(x_{k+1}; μ_θ(x_k), std²), rollouts.py), ratio ρ_b = exp(π_b − π_old,b),
        loss_b = max(−A_b·ρ_b, −A_b·clip(ρ_b, 1 − ε, 1 + ε)) + β·KL_b,
        KL_b = mean over elements of (μ_θ − μ_ref)² / (2·std²)      (equal-variance Gaussians)
    π_b is a sum over the clip's tokens, which CP splits over ranks: a no-grad pass, the
    statistics sync and constant coefficients c_b = ∂loss_b/∂π_b (like DPO, losses.py); the
    KL is a per-token term with weight 1/T_b. Normalize with "num_sequences" (transitions).

diffusion_dpo_loss (Wallace et al. 2024, "Diffusion-DPO"), pairs 2k (chosen) / 2k+1 (rejected)
    of the same caption: m_b = the clip's token-mean flow-matching error (1/T_b Σ_t MSE_t, a
    per-sequence statistic, synced), m_ref,b the reference model's on the same noisy clip
    (`ref_loss`, from the reference session's `forward`),
        loss = −log σ(−β·((m_c − m_ref,c) − (m_r − m_ref,r)))
    Normalize with "num_sequences" (pairs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dit_train.loss import inverse_sample_tokens
from dit_train.posttrain.losses import DPOLoss, LossFn, TokenInputs, dpo_pair_terms, log_ratio
from dit_train.posttrain.rollouts import gaussian_logpdf, sde_mean

# -- pure per-token functions --------------------------------------------------------------------


def nft_reward_weight(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """r = 1/2 + 1/2·clip(A / adv_clip, −1, 1) ∈ [0, 1]: the optimality probability of DiffusionNFT."""
    return 0.5 + 0.5 * (advantages.float() / adv_clip).clamp(-1.0, 1.0)


def nft_token_loss(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor, beta: float
                   ) -> torch.Tensor:
    """[L] DiffusionNFT per token from v, v_old, target [L, D] and r [L] (module docstring)."""
    pos = (1 - beta) * v_old + beta * v
    neg = (1 + beta) * v_old - beta * v
    t = target.float()
    return r * (pos - t).pow(2).mean(-1) + (1 - r) * (neg - t).pow(2).mean(-1)


def transition_token_logprob(v: torch.Tensor, x: torch.Tensor, next_x: torch.Tensor, sigma: torch.Tensor,
                             sigma_next: torch.Tensor, s: torch.Tensor, std: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """([L] mean over the token's values of log N(next; μ, std²), μ [L, D]) of SDE transitions
    (v, x, next [L, D]; the step's scalars [L]). Computed in float64: the log-probability's
    terms are large and nearly cancel in ratios."""
    col = [t.double()[:, None] for t in (sigma, sigma_next, s, std)]
    mean = sde_mean(x.double(), v.double(), col[0], col[1], col[2])
    return gaussian_logpdf(next_x.double(), mean, col[3]).mean(-1), mean


# -- loss functions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiffusionNFTLoss(LossFn):
    """DiffusionNFT on VideoDatums with a per-clip `advantages` (module docstring)."""

    beta: float = 1.0
    adv_clip: float = 5.0

    name: ClassVar[str] = "diffusion_nft"
    video_inputs: ClassVar[str] = "clips"

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.beta or not 0 < self.adv_clip:
            raise ValueError(f"diffusion_nft_loss: beta={self.beta} and adv_clip={self.adv_clip} must be > 0")

    def required_fields(self) -> tuple[str, ...]:
        return ("advantages",)

    def token_loss(self, x: TokenInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v = x.fields["velocity"]
        r = nft_reward_weight(x.fields["advantages"], self.adv_clip)
        v_old = x.fields["old_velocity"].float() if "old_velocity" in x.fields else v.detach()
        return nft_token_loss(v, v_old, x.fields["target"], r, self.beta), {"reward_weight": r.detach()}


@dataclass(frozen=True)
class FlowGRPOLoss(LossFn):
    """Flow-GRPO on VideoTransitions (module docstring). agg is per transition (1/T_b)."""

    clip_range: float = 1e-4
    kl_coef: float = 0.0

    name: ClassVar[str] = "flow_grpo"
    video_inputs: ClassVar[str] = "transitions"
    sequence_level: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.agg != "token" or self.horizon:
            raise ValueError("flow_grpo_loss averages each transition over its tokens: agg and horizon do not apply")
        if self.clip_range <= 0 or self.kl_coef < 0:
            raise ValueError(f"flow_grpo_loss: clip_range={self.clip_range} must be > 0, kl_coef={self.kl_coef} >= 0")

    def aggregation_weights(self, w, seg, valid, counts, micro):
        a = inverse_sample_tokens(seg, valid, counts, micro)
        n = counts.num_samples
        return a if self.raw_sum else (a / n if n > 0 else a * 0)

    def statistic(self, x: TokenInputs) -> torch.Tensor:
        f = x.fields
        return transition_token_logprob(f["velocity"], f["x"], f["next"], f["sigma"], f["sigma_next"], f["s"],
                                        f["std"])[0]

    def sequence_terms(self, policy: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """From the full per-transition log-probs [S]: (coef [S] = ∂loss_b/∂π_b, loss [S],
        {clip_fraction, ratio: [S]})."""
        ratio = torch.exp(log_ratio(policy, old, torch.ones_like(policy, dtype=torch.bool)))
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1 - self.clip_range, 1 + self.clip_range)
        use_unclipped = unclipped >= clipped  # max(): the gradient flows through the unclipped term only
        coef = torch.where(use_unclipped, -advantages * ratio, torch.zeros_like(ratio))
        stats = {"clip_fraction": (~use_unclipped).double(), "ratio": ratio}
        return coef, torch.maximum(unclipped, clipped), stats

    def token_loss(self, x: TokenInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        f = x.fields
        logp, mean = transition_token_logprob(f["velocity"], f["x"], f["next"], f["sigma"], f["sigma_next"], f["s"],
                                              f["std"])
        loss = x.coef.double() * logp
        stats = {}
        if self.kl_coef:
            kl = ((mean - f["ref_mean"].double()).pow(2).mean(-1) / (2 * f["std"].double() ** 2))
            loss = loss + self.kl_coef * kl
            stats["kl"] = kl.detach()
        return loss.float(), stats


@dataclass(frozen=True)
class DiffusionDPOLoss(DPOLoss):
    """Diffusion-DPO on VideoDatum pairs with `ref_loss` (module docstring)."""

    beta: float = 100.0

    name: ClassVar[str] = "diffusion_dpo"
    needs_logprobs: ClassVar[bool] = False
    video_inputs: ClassVar[str] = "clips"

    def required_fields(self) -> tuple[str, ...]:
        return ("ref_loss",)

    def check(self, datums: list) -> None:
        if len(datums) % 2:
            raise ValueError(f"diffusion_dpo_loss takes pairs: datums 2k (chosen) and 2k+1 (rejected); this call has "
                             f"{len(datums)} datums")
        for k in range(0, len(datums), 2):
            if datums[k].caption != datums[k + 1].caption:
                raise ValueError(f"datum {k + 1}: caption {datums[k + 1].caption!r} differs from its chosen clip's "
                                 f"(datum {k}: {datums[k].caption!r}); a pair compares two clips of one caption")

    def aggregation_weights(self, w, seg, valid, counts, micro):
        a = inverse_sample_tokens(seg, valid, counts, micro)
        pairs = counts.num_samples // 2
        return a if self.raw_sum else (a / pairs if pairs > 0 else a * 0)

    def statistic(self, x: TokenInputs) -> torch.Tensor:
        return -x.nll  # with weights 1/T_b: π_b = −(the clip's token-mean flow-matching error)

    def sequence_terms(self, policy: torch.Tensor, reference: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        loss, margin, coef = dpo_pair_terms(policy, reference, self.beta)
        return coef, loss, {"reward_accuracy": (margin > 0).double(), "reward_margin": margin}

    def token_loss(self, x: TokenInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.coef * self.statistic(x), {}


def diffusion_nft_loss(beta: float = 1.0, adv_clip: float = 5.0, raw_sum: bool = True, agg: str = "token"
                       ) -> DiffusionNFTLoss:
    """DiffusionNFT: the flow-matching loss on positive and negative rollouts (module docstring)."""
    return DiffusionNFTLoss(raw_sum=raw_sum, agg=agg, beta=beta, adv_clip=adv_clip)


def flow_grpo_loss(clip_range: float = 1e-4, kl_coef: float = 0.0, raw_sum: bool = True) -> FlowGRPOLoss:
    """Flow-GRPO: clipped ratio of each SDE transition (+ KL to the reference's mean)."""
    return FlowGRPOLoss(raw_sum=raw_sum, clip_range=clip_range, kl_coef=kl_coef)


def diffusion_dpo_loss(beta: float = 100.0, raw_sum: bool = True) -> DiffusionDPOLoss:
    """Diffusion-DPO on (chosen, rejected) clip pairs against the reference's errors."""
    return DiffusionDPOLoss(raw_sum=raw_sum, beta=beta)
