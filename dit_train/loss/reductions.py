"""Loss reductions as per-token weight functions (pure: no communication, no state).

The global loss of a step is L = Σ_{ranks, micro-batches, tokens} a·l. Each rank
back-propagates its local Σ a·l and gradients are summed over ranks, so the gradient equals
the single-device gradient of L exactly when a depends only on the token's own loss weight w_t
(0 = context or ignored, 1 = a whole token, fractional = a soft mask) and global counts
(StepCounts: T_b = Σ_t w_t of the sample, N_global = Σ w, B_global = samples with T_b > 0):

    token_mean   a = w_t / N_global                 (LLM default)
    sample_mean  a = w_t / (B_global · T_b)         (video default; every sample weighs the same)
    sample_sum   a = w_t / B_global
    sum          a = w_t
    naive_mean   a = w_t / (n_local · M · W)        per-rank mean (n_local = Σ w of the micro-
                                                    batch on this rank), averaged over M micro-
                                                    batches and W = dp·cp ranks: the biased recipe
With 0/1 weights (`PackedBatch.valid`) these are the textbook token and sample means.

Several streams per sample (audio + video, `PackedBatch.stream`): sample_mean becomes a sum
over streams s of a hierarchical mean per stream, with λ_s = loss.stream_weights.<s>:

    a = λ_s · w_t / (B_s · T_{b,s})    T_{b,s} = Σ w of sample b's tokens of stream s,
                                        B_s = samples with T_{b,s} > 0 (`stream_token_weights`)
so a clip without audio is not in B_audio and changes no other clip's audio weight, and a
clip's audio weighs λ_audio/B_audio whichever clips share its micro-batch or rank.
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

    Token sums are sums of loss weights in token units (a whole token weighs 1): with 0/1
    weights they are token counts (whole numbers), with fractional weights fractions of k/65535.

    sample_tokens[k]: [S_k] float64 T_b = Σ_t w_t of each sample of micro-batch k, over the whole
        sample (summed over its CP group); the same on every CP rank of the group.
    num_samples: B_global, samples with T_b > 0, over all micro-batches and DP ranks.
    num_tokens: N_global = Σ w over all micro-batches and all ranks (DP × CP); an int when whole.
    local_tokens[k]: Σ w of micro-batch k on this rank only (for naive_mean).
    world: DP × CP ranks (for naive_mean's averaging).
    stream_tokens[k]: [S_k, n] float64 T_{b,s} of each sample and stream (summed over the CP
        group; rows sum to sample_tokens[k]); None when the step was synced with one stream.
    stream_samples: [n] B_s, samples with T_{b,s} > 0 over all micro-batches and DP ranks; None
        with one stream.
    """

    sample_tokens: list[torch.Tensor]
    num_samples: int
    num_tokens: int | float
    local_tokens: list[int | float]
    world: int
    stream_tokens: list[torch.Tensor] | None = None
    stream_samples: list[int] | None = None

    @property
    def num_micro(self) -> int:
        return len(self.sample_tokens)


def inverse_sample_tokens(seg: torch.Tensor, valid: torch.Tensor, meta: StepCounts, micro: int) -> torch.Tensor:
    """[L] fp32 1 / T_b of each valid local token's sample (0 for padding, ignored and context
    tokens): the weight of a per-sample token mean, before the token's own weight and any
    division by the number of samples. valid: [L] bool, or [L] weights (valid where > 0)."""
    T = meta.sample_tokens[micro].to(device=seg.device, dtype=torch.float32)
    T_tok = T[seg.clamp(min=0)] if T.numel() else torch.zeros(seg.shape, dtype=torch.float32, device=seg.device)
    keep = (valid if valid.dtype == torch.bool else valid > 0) & (T_tok > 0) & (seg >= 0)
    return torch.where(keep, 1.0 / torch.where(keep, T_tok, 1.0), 0.0)


def stream_token_weights(seg: torch.Tensor, stream: torch.Tensor, weight: torch.Tensor, meta: StepCounts, micro: int,
                         lambdas: tuple[float, ...]) -> torch.Tensor:
    """[L] fp32 a_t = λ_s · w_t / (B_s · T_{b,s}) of each local token of micro-batch `micro`: the
    per-stream hierarchical mean (module docstring). stream: [L] int64 the token's stream
    (`PackedBatch.stream`); lambdas: λ per stream, in `STREAMS` order. A token whose sample has
    no weight in its stream, or whose stream no sample of the step has, gets 0."""
    if meta.stream_tokens is None or meta.stream_samples is None:
        raise ValueError("stream weights need counts synced per stream (sync_counts(..., streams=n))")
    n = len(meta.stream_samples)
    if len(lambdas) != n:
        raise ValueError(f"{len(lambdas)} stream weights for {n} streams")
    v = weight.to(torch.float32)
    T = meta.stream_tokens[micro].to(device=seg.device, dtype=torch.float32)  # [S, n]
    s = stream.clamp(0, n - 1)
    T_tok = T[seg.clamp(min=0), s] if T.numel() else torch.zeros(seg.shape, dtype=torch.float32, device=seg.device)
    B = torch.tensor(meta.stream_samples, dtype=torch.float32, device=seg.device)[s]
    lam = torch.tensor(lambdas, dtype=torch.float32, device=seg.device)[s]
    keep = (v > 0) & (T_tok > 0) & (B > 0) & (seg >= 0)
    return torch.where(keep, lam * v / torch.where(keep, B * T_tok, 1.0), 0.0)


def token_weights(reduction: str, seg: torch.Tensor, weight: torch.Tensor, meta: StepCounts, micro: int,
                  stream: torch.Tensor | None = None, lambdas: tuple[float, ...] | None = None) -> torch.Tensor:
    """[L] fp32 weight a_t of each local token of micro-batch `micro` (see the module docstring).

    seg: [L] sample index in the pack (-1 padding); weight: [L] the tokens' loss weights w_t
    (`PackedBatch.loss_weight()`), or the bool `valid` mask for 0/1 weights. Tokens of weight
    0, and samples or steps whose weights sum to 0, get 0 (never a division by zero).
    stream, lambdas: the tokens' streams ([L] int64, `PackedBatch.stream`) and λ per stream of a
    multi-stream pack (sample_mean only: `stream_token_weights`); None = one stream.
    """
    if stream is not None:
        if reduction != "sample_mean":
            raise ValueError(f"loss.reduction={reduction!r}: a pack with several streams is reduced by "
                             "sample_mean (a hierarchical mean per stream)")
        return stream_token_weights(seg, stream, weight, meta, micro, lambdas or (1.0,) * len(meta.stream_samples or ()))
    v = weight.to(torch.float32)
    if reduction == "token_mean":
        return v / meta.num_tokens if meta.num_tokens > 0 else v * 0
    if reduction == "sample_mean":
        if meta.num_samples == 0:
            return v * 0
        return v * inverse_sample_tokens(seg, v > 0, meta, micro) / meta.num_samples
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
