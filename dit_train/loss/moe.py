"""Router losses of mixture-of-experts layers as per-token losses (pure: no communication).

Load balancing is defined per *sample* (sequence-wise balance): for sample b with token loss
weights w_t (1 for a plain token, 0 for padding and context, fractional under a soft mask:
loss/reductions.py), T_b = Σ_{t ∈ b} w_t, E experts and top-k routing,

    f_{b,i} = (Σ_{t ∈ b} w_t · [t routed to expert i]) / (k · T_b)         (a count: no gradient)
    P_{b,i} = (1 / T_b) · Σ_{t ∈ b} w_t · p_{t,i}
    balance_b = E · Σ_i f_{b,i} · P_{b,i}                                    (1 when perfectly balanced)

With 0/1 weights f counts the routed slots of b's valid tokens. The counts are sums of int64
weight units (batch.WEIGHT_ONE), exact in any order like T_b.
balance_b = Σ_{t ∈ b} (w_t / T_b) · a_t with the per-token term a_t = E · Σ_i f_{b,i} · p_{t,i}.
So a_t, weighted by the main loss's token weights w_t (loss/reductions.py), gives exactly the
reduction's weighting of the samples' terms: sample_mean w_t = 1/(B_global·T_b) -> Σ_b
balance_b / B_global; token_mean w_t = 1/N_global -> Σ_b (T_b/N_global)·balance_b. The same
`aux_loss_coef` then means the same at any grad_accum, micro-batch size, DP and CP.

Under CP a sample's tokens sit on several ranks: its counts f_{b,i} are summed within the CP
group (`loss.counts.sync_expert_counts`, like T_b), and each rank back-propagates only its own
tokens' w_t·a_t — the gradient of balance_b with respect to p needs f (a constant), not a
differentiable collective. The z-loss is per token already: z_t = logsumexp(logits_t)².

Both are averaged over the model's MoE layers.
"""
from __future__ import annotations

import torch

from dit_train.batch import WEIGHT_ONE
from dit_train.models.moe import Routing


def local_expert_counts(routings: list[Routing], seg: torch.Tensor, weight: torch.Tensor, num_samples: int,
                        num_experts: int) -> torch.Tensor:
    """[M, S, E] int64: routed slots of each sample's *local* tokens per expert, each slot counted
    with its token's loss weight in units of 1/WEIGHT_ONE, for each of the M MoE layers.
    seg: [L] sample of each token (-1 padding); weight: [L] int64 weight units
    (`PackedBatch.weight_units()`), or [L] bool valid (a whole token each)."""
    units = weight.to(torch.int64) * WEIGHT_ONE if weight.dtype == torch.bool else weight
    out = torch.zeros(len(routings), num_samples, num_experts, dtype=torch.int64, device=seg.device)
    keep = (units > 0) & (seg >= 0)
    for m, r in enumerate(routings):
        chosen = r.experts[keep]  # [n, k]
        rows = seg[keep].unsqueeze(1).expand_as(chosen)
        w = units[keep].unsqueeze(1).expand_as(chosen)
        out[m].index_put_((rows.reshape(-1), chosen.reshape(-1)), w.reshape(-1), accumulate=True)
    return out


def router_token_losses(routings: list[Routing], counts: torch.Tensor, sample_tokens: torch.Tensor,
                        seg: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token balance term a_t and z-loss z_t ([L] fp32 each), averaged over MoE layers.

    counts: [M, S, E] weighted expert counts of whole samples in weight units
    (`local_expert_counts` summed within the CP group); sample_tokens: [S] T_b = Σ w
    (StepCounts.sample_tokens of this micro-batch);
    seg: [L]. Padding tokens get 0 (their weight is 0 too).
    """
    M, S, E = counts.shape
    T = sample_tokens.to(device=counts.device, dtype=torch.float64)
    T = torch.where(T > 0, T, 1.0)  # a sample of weight 0 (all context, an all-zero mask) has counts 0
    f = (counts.double() / WEIGHT_ONE / (top_k * T)[None, :, None]).float()  # [M, S, E]
    f = torch.cat([f, f.new_zeros(M, 1, E)], dim=1)  # row S: padding
    row = torch.where(seg < 0, torch.full_like(seg, S), seg)
    aux = torch.zeros(seg.shape, dtype=torch.float32, device=seg.device)
    z = torch.zeros_like(aux)
    for m, r in enumerate(routings):
        aux = aux + E * (f[m].index_select(0, row) * r.probs).sum(dim=-1)
        z = z + torch.logsumexp(r.logits, dim=-1).square()
    pad = (seg >= 0).to(torch.float32)
    return aux * pad / M, z * pad / M


def expert_load(counts: torch.Tensor) -> tuple[float, float]:
    """(smallest, largest) share of routed slots an expert received (each slot weighted by its
    token's loss weight): counts [M, E] summed over samples of the step (all ranks), per layer;
    min and max over experts and layers.
    Perfect balance gives (1/E, 1/E)."""
    share = counts.double() / counts.sum(dim=-1, keepdim=True).clamp(min=1)
    return float(share.min()), float(share.max())
