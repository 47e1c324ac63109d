"""Loss reductions as per-token weight functions (pure: no communication, no state).

The global loss of a step is L = Σ_{ranks, micro-batches, tokens} w·l. Each rank
back-propagates its local Σ w·l and gradients are summed over ranks, so the gradient equals
the single-device gradient of L exactly when w depends only on global counts (StepCounts):

    token_mean   w = 1 / N_global                 (LLM default)
    sample_mean  w = 1 / (B_global · T_b)         (video default; every sample weighs the same)
    sample_sum   w = 1 / B_global
    sum          w = 1
    naive_mean   w = 1 / (n_local · M · W)        per-rank mean, averaged over M micro-batches
                                                  and W = dp·cp ranks: the common, biased recipe
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dit_train.config.choices import Reduction

REDUCTIONS = Reduction.values()
# reductions whose result is independent of the layout (naive_mean is the ablation)
EXACT_REDUCTIONS = ("sample_mean", "token_mean", "sample_sum", "sum")


@dataclass
class StepCounts:
    """Global counts of one optimizer step (output of `sync_counts`).

    sample_tokens[k]: [S_k] T_b, valid tokens of each sample of micro-batch k, over the whole
        sample (summed over its CP group); the same on every CP rank of the group.
    num_samples: B_global, samples with at least one valid token, over all micro-batches and DP ranks.
    num_tokens: N_global, valid tokens over all micro-batches and all ranks (DP × CP).
    local_tokens[k]: valid tokens of micro-batch k on this rank only (for naive_mean).
    world: DP × CP ranks (for naive_mean's averaging).
    """

    sample_tokens: list[torch.Tensor]
    num_samples: int
    num_tokens: int
    local_tokens: list[int]
    world: int

    @property
    def num_micro(self) -> int:
        return len(self.sample_tokens)


def inverse_sample_tokens(seg: torch.Tensor, valid: torch.Tensor, meta: StepCounts, micro: int) -> torch.Tensor:
    """[L] fp32 1 / T_b of each valid local token's sample (0 for padding and ignored tokens):
    the weight of a per-sample token mean, before any division by the number of samples."""
    T = meta.sample_tokens[micro].to(device=seg.device, dtype=torch.float32)
    T_tok = T[seg.clamp(min=0)] if T.numel() else torch.zeros(seg.shape, dtype=torch.float32, device=seg.device)
    return torch.where(valid & (T_tok > 0), 1.0 / T_tok.clamp(min=1.0), 0.0)


def token_weights(reduction: str, seg: torch.Tensor, valid: torch.Tensor, meta: StepCounts, micro: int) -> torch.Tensor:
    """[L] fp32 weight of each local token of micro-batch `micro`.

    seg: [L] sample index in the pack (-1 padding); valid: [L] bool. Tokens that are not valid,
    and samples or steps without valid tokens, get weight 0 (never a division by zero).
    """
    v = valid.to(torch.float32)
    if reduction == "token_mean":
        return v / meta.num_tokens if meta.num_tokens > 0 else v * 0
    if reduction == "sample_mean":
        if meta.num_samples == 0:
            return v * 0
        return inverse_sample_tokens(seg, valid, meta, micro) / meta.num_samples
    if reduction == "sample_sum":
        return v / meta.num_samples if meta.num_samples > 0 else v * 0
    if reduction == "sum":
        return v
    if reduction == "naive_mean":
        n = meta.local_tokens[micro]
        return v / (n * meta.num_micro * meta.world) if n > 0 else v * 0
    raise ValueError(f"loss.reduction={reduction!r} must be one of {REDUCTIONS}")


def weighted_loss(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w·l over this micro-batch's local tokens (what each rank back-propagates)."""
    return (per_token.float() * weights).sum()
