"""Loss functions of the session: pure per-token functions and how a call aggregates them.

A `forward_backward` call back-propagates  Σ_t a_t · l_t  over all its tokens (every rank,
every micro-batch), where
  l_t  is the loss function's per-token value (a pure function of the token's log-prob and the
       caller's per-token inputs: advantages, old / reference log-probs),
  a_t  is its aggregation weight: the caller's weight w_t (0 = no gradient), divided by the
       sequence's weighted-token count T_b for agg="sequence", by a constant horizon H when
       given, and by the call's own global count when raw_sum=False.
T_b and the call's counts come from the metadata sync (global over DP × CP), so the sum is the
one-process sum on every layout. `optim_step(normalization=...)` then divides by the counts of
all calls of the step:

| loss                      | raw_sum | agg        | optim_step          | verl loss_agg_mode         |
|---------------------------|---------|------------|---------------------|----------------------------|
| sft_loss / grpo_loss      | True    | "token"    | "num_loss_tokens"   | token-mean                 |
| sft_loss / grpo_loss      | True    | "token"    | "num_sequences"     | seq-mean-token-sum         |
| sft_loss / grpo_loss      | True    | "sequence" | "num_sequences"     | seq-mean-token-mean        |
| sft_loss / grpo_loss(H)   | True    | "token", H | "num_sequences"     | seq-mean-token-sum-norm    |
| dpo_loss                  | True    | pairs      | "num_sequences"     | (pairs: num_sequences counts pairs) |
| any                       | False   | any        | "none"              | (per call: already normalized) |

DPO needs the log-prob sum of each whole sequence, which context parallelism splits across
ranks. It never back-propagates through a collective: its gradient w.r.t. each token's log-prob
is c_b · w_t, with c_b a per-sequence scalar. The session computes the sums in a no-grad
forward, sums the parts over the ranks (`sync_sequence_sums`), and the loss back-propagates
c_b · w_t · log p_t with c_b a constant (`sequence_terms`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from dit_train.loss import StepCounts, inverse_sample_tokens

AGGREGATIONS = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0  # |log π/π_old| above this is clamped before exp (inf ratios make NaN gradients)


@dataclass
class TokenInputs:
    """What a loss function sees of one micro-batch on this rank ([L_local] each).

    nll: −log p of each token under the current model (grad flows; video: the flow-matching MSE);
    valid: the token carries a non-zero weight; fields: the caller's per-token inputs
    (advantages, old_logprobs, ref_logprobs); coef: per-token value of the sequence coefficient
    of sequence-level losses (DPO), else None.
    """

    nll: torch.Tensor
    valid: torch.Tensor
    fields: dict[str, torch.Tensor]
    coef: torch.Tensor | None = None


# -- pure per-token functions -------------------------------------------------------------------


def log_ratio(logp: torch.Tensor, other: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[L] log(π/π_other), 0 off valid tokens, clamped to ±LOG_RATIO_CLAMP."""
    return torch.where(valid, logp - other, torch.zeros_like(logp)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_policy_gradient(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
                            clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: max(−A·r, −A·clip(r, 1−clip_low, 1+clip_high)),
    r = π/π_old. Returns (loss [L], clipped [L] bool, ratio [L])."""
    ratio = torch.exp(log_ratio(logp, old, valid))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped) & valid, ratio


def k3_kl(logp: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[L] per-token KL(π‖π_ref) estimate k3 = exp(ref − logp) − (ref − logp) − 1 (>= 0;
    verl's low_var_kl without its clamp of the result)."""
    d = log_ratio(ref, logp, valid)
    return torch.exp(d) - d - 1.0


def dpo_pair_terms(policy: torch.Tensor, reference: torch.Tensor, beta: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO on pairs (2k = chosen, 2k+1 = rejected) from per-sequence log-prob sums [2P].

    Returns (loss [P] = −log σ(margin), margin [P] = β·((π_c − ref_c) − (π_r − ref_r)),
    coef [2P] = d loss / d π_b: −β·σ(−margin) for the chosen, +β·σ(−margin) for the rejected).
    """
    delta = (policy - reference).view(-1, 2)
    margin = beta * (delta[:, 0] - delta[:, 1])
    g = beta * torch.sigmoid(-margin)
    return F.softplus(-margin), margin, torch.stack([-g, g], dim=1).reshape(-1)


# -- loss functions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossFn:
    """A loss function of the session: per-token values and their aggregation.

    raw_sum: True when the call leaves the division by a count to optim_step (required for
        "num_loss_tokens" / "num_sequences"); False when the call already divides by its own
        global count (use optim_step(normalization="none")).
    agg: "token" (w_t) or "sequence" (w_t / T_b: each sequence's token mean, summed).
    horizon: > 0 divides every token by this constant (Dr. GRPO; verl's seq-mean-token-sum-norm).
    """

    raw_sum: bool = True
    agg: str = "token"
    horizon: int = 0

    name: ClassVar[str] = "loss"
    needs_logprobs: ClassVar[bool] = False  # a log-prob loss: mode=llm only
    group_size: ClassVar[int] = 1  # datums per example: num_sequences counts examples
    sequence_level: ClassVar[bool] = False  # needs the per-sequence statistics (sequence_terms)
    video_inputs: ClassVar[str] = ""  # mode=video reward losses: "clips" (VideoDatum) or "transitions"

    def __post_init__(self):
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"{self.name}: agg={self.agg!r} must be one of {AGGREGATIONS}")
        if self.horizon < 0:
            raise ValueError(f"{self.name}: horizon={self.horizon} must be >= 0 (0 = none)")

    def required_fields(self) -> tuple[str, ...]:
        return ()

    def check(self, datums: list) -> None:
        """Refuse a call whose datums lack what this loss needs (ValueError naming the datum)."""
        for field in self.required_fields():
            for i, d in enumerate(datums):
                if getattr(d, field, None) is None:
                    raise ValueError(f"datum {i}: {field} is required by {self.name}_loss")

    def aggregation_weights(self, w: torch.Tensor, seg: torch.Tensor, valid: torch.Tensor, counts: StepCounts,
                            micro: int) -> torch.Tensor:
        """[L] fp32 a_t of micro-batch `micro` from the caller's weights w [L] and the call's
        global counts (pure: no communication)."""
        a = torch.where(valid, w.float(), torch.zeros_like(w, dtype=torch.float32))
        if self.agg == "sequence":
            a = a * inverse_sample_tokens(seg, valid, counts, micro)
        if self.horizon:
            a = a / self.horizon
        if not self.raw_sum:
            n = counts.num_tokens if self.agg == "token" else counts.num_samples
            a = a / n if n > 0 else a * 0
        return a

    def token_loss(self, x: TokenInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """([L] per-token loss, {name: [L] per-token statistic, reported as weighted means})."""
        raise NotImplementedError

    def statistic(self, x: TokenInputs) -> torch.Tensor:
        """Sequence-level losses: [L] each token's part of its sequence's statistic π_b (summed
        with the aggregation weights: π_b = Σ_t a_t·statistic_t; DPO: log p_t)."""
        return -x.nll


@dataclass(frozen=True)
class SFTLoss(LossFn):
    """The task's own per-token loss: cross-entropy −log p (llm), flow-matching MSE (video)."""

    name: ClassVar[str] = "sft"

    def token_loss(self, x: TokenInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.nll, {}


@dataclass(frozen=True)
class PolicyGradientLoss(LossFn):
    """GRPO / PPO: clipped importance-ratio policy gradient with per-token advantages, plus an
    optional k3 KL penalty to the reference model. Without old_logprobs the ratio is taken to
    the current weights (on-policy: r = 1, gradient −A·∇log p)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0

    name: ClassVar[str] = "grpo"
    needs_logprobs: ClassVar[bool] = True

    def required_fields(self) -> tuple[str, ...]:
        return ("advantages", "ref_logprobs") if self.kl_coef else ("advantages",)

    def token_loss(self, x: TokenInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp = -x.nll
        old = x.fields.get("old_logprobs", logp.detach())
        loss, clipped, ratio = clipped_policy_gradient(logp, old, x.fields["advantages"], x.valid, self.clip_low,
                                                       self.clip_high)
        stats = {"clip_fraction": clipped.float(), "ratio": ratio.detach()}
        if self.kl_coef:
            kl = k3_kl(logp, x.fields["ref_logprobs"], x.valid)
            loss = loss + self.kl_coef * kl
            stats["kl"] = kl.detach()
        return loss, stats


@dataclass(frozen=True)
class DPOLoss(LossFn):
    """DPO over pairs: datums 2k (chosen) and 2k+1 (rejected) of every call. A pair is one
    example: num_sequences counts pairs, and raw_sum=False divides by the call's pairs."""

    beta: float = 0.1

    name: ClassVar[str] = "dpo"
    needs_logprobs: ClassVar[bool] = True
    group_size: ClassVar[int] = 2
    sequence_level: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.agg != "token" or self.horizon:
            raise ValueError("dpo_loss aggregates per pair: agg and horizon do not apply")

    def required_fields(self) -> tuple[str, ...]:
        return ("ref_logprobs",)

    def check(self, datums: list) -> None:
        if len(datums) % 2:
            raise ValueError(f"dpo_loss takes pairs: datums 2k (chosen) and 2k+1 (rejected); this call has "
                             f"{len(datums)} datums")
        super().check(datums)
        for i, d in enumerate(datums):
            if not bool((d.weights != 0).any()):
                role = "chosen" if i % 2 == 0 else "rejected"
                raise ValueError(f"datum {i}: weights are all 0, but it is the {role} sequence of pair {i // 2} "
                                 f"(a DPO sequence needs at least one weighted token)")

    def aggregation_weights(self, w, seg, valid, counts, micro):
        a = torch.where(valid, w.float(), torch.zeros_like(w, dtype=torch.float32))
        pairs = counts.num_samples // 2
        return a if self.raw_sum else (a / pairs if pairs > 0 else a * 0)

    def sequence_terms(self, policy: torch.Tensor, reference: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """From the call's full per-sequence sums [S] (S = 2P, identical on every rank):
        (coef [S] = d loss / d π_b, loss [P] per pair, {statistic: [P]})."""
        loss, margin, coef = dpo_pair_terms(policy, reference, self.beta)
        return coef, loss, {"reward_accuracy": (margin > 0).double(), "reward_margin": margin}

    def token_loss(self, x: TokenInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # gradient c_b·w_t·∇log p_t: exactly DPO's, since d loss/d log p_t = c_b·w_t (the value
        # of this surrogate is not the loss; the session reports sequence_terms' loss instead)
        return x.coef * self.statistic(x), {}


def sft_loss(raw_sum: bool = True, agg: str = "token", horizon: int = 0) -> SFTLoss:
    """Supervised loss Σ a_t·(−log p_t) (video: Σ a_t·MSE_t); see the module table."""
    return SFTLoss(raw_sum=raw_sum, agg=agg, horizon=horizon)


def grpo_loss(clip_low: float = 0.2, clip_high: float | None = None, kl_coef: float = 0.0, raw_sum: bool = True,
              agg: str = "token", horizon: int = 0) -> PolicyGradientLoss:
    """GRPO / PPO clipped policy gradient (clip_high defaults to clip_low; DAPO raises it)."""
    return PolicyGradientLoss(raw_sum=raw_sum, agg=agg, horizon=horizon, clip_low=clip_low,
                              clip_high=clip_low if clip_high is None else clip_high, kl_coef=kl_coef)


def dpo_loss(beta: float = 0.1, raw_sum: bool = True) -> DPOLoss:
    """DPO: −log σ(β·((π_c − ref_c) − (π_r − ref_r))) per pair, π = Σ_t w_t·log p_t."""
    return DPOLoss(raw_sum=raw_sum, beta=beta)


# the first session API's names (dataset ids; still the task's own loss)
def token_sum_loss() -> SFTLoss:
    """Σ over valid tokens of the per-token loss (raw_sum=True)."""
    return sft_loss()


def sequence_mean_sum_loss() -> SFTLoss:
    """Σ over sequences of each sequence's token mean (raw_sum=True; use num_sequences)."""
    return sft_loss(agg="sequence")


def token_mean_loss() -> SFTLoss:
    """Token mean over this call's global valid tokens (raw_sum=False; use normalization='none')."""
    return sft_loss(raw_sum=False)


VERL_LOSS_AGG_MODES = {
    "token-mean": ({"agg": "token"}, "num_loss_tokens"),
    "seq-mean-token-sum": ({"agg": "token"}, "num_sequences"),
    "seq-mean-token-mean": ({"agg": "sequence"}, "num_sequences"),
    "seq-mean-token-sum-norm": ({"agg": "token"}, "num_sequences"),  # plus horizon=H
}


def verl_loss_agg_mode(mode: str, horizon: int = 0) -> tuple[dict, str]:
    """(loss keyword arguments, optim_step normalization) of verl's `loss_agg_mode`:

        kwargs, norm = verl_loss_agg_mode("seq-mean-token-mean")
        session.forward_backward(batch, grpo_loss(**kwargs)); session.optim_step(norm)

    seq-mean-token-sum-norm needs the constant horizon H (verl: the padded response length):
    here it is Σ w·l / (H · num_sequences) over the whole step, where verl divides each
    micro-batch's Σ by H and averages micro-batches (the same when they hold equal sequences).
    """
    if mode not in VERL_LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} must be one of {sorted(VERL_LOSS_AGG_MODES)}")
    kwargs, norm = VERL_LOSS_AGG_MODES[mode]
    if mode == "seq-mean-token-sum-norm":
        if horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm divides by a constant horizon: pass horizon=H (e.g. the "
                             "longest response length)")
        kwargs = {**kwargs, "horizon": horizon}
    return dict(kwargs), norm
