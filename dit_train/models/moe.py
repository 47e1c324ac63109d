"""Mixture-of-experts feed-forward: token-choice top-k routing, dropless.

`MoEFeedForward` replaces a block's MLP (`model.moe.num_experts` > 0, every `model.moe.every`-th
block). Each token goes to the k experts with the largest router probability; their outputs
are mixed with those probabilities renormalised over the k chosen (Mixtral). Dropless: every
expert processes every token routed to it (no capacity, no dropped tokens), so the result
does not depend on how tokens are grouped into micro-batches or ranks.

The router runs in fp32 whatever the autocast or FSDP2 mixed-precision state: routing is a
discrete decision on small logit differences, and rounding them to bf16 would flip choices
(parallel/parallelize.py gives the router its own fp32 FSDP unit).

The layer computes no loss and holds no parallelism. It keeps what the load-balancing and
z-losses need (`routing`: logits, probabilities and choices of the last forward) for the loss
path (dit_train/loss/moe.py), which weights them per sample with the step's global counts.
Expert dispatch is a callable (`dispatch`), local by default; expert parallelism swaps it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.models.recompute import Prologue


@dataclass
class Routing:
    """The router's output for the L local tokens of one forward.

    logits: [L, E] fp32 router logits (z-loss), probs: [L, E] fp32 softmax (balance loss),
    experts: [L, k] int64 chosen experts (no gradient: the balance loss counts them).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor


class Experts(nn.Module):
    """E two-layer GELU MLPs stored as stacked weights (one tensor per kind, experts on dim 0,
    so expert parallelism can split them by rows): w1 [E, h, d], b1 [E, h], w2 [E, d, h], b2 [E, d].

    forward(x, counts): x [N, d] tokens sorted by expert, counts[e] tokens of expert e -> [N, d].
    `first` is the global index of this module's first expert (0 unless experts are split).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return run_experts((self.w1, self.b1, self.w2, self.b2), x, counts)

    @torch.no_grad()
    def init_parameter(self, name: str, full: torch.Tensor, gen: torch.Generator, scheme: str, std: float) -> torch.Tensor:
        """Initial value of parameter `name` (models/init.py): each expert like an nn.Linear
        of the dense MLP (xavier uniform, zero bias; N(0, std) everywhere for scheme=normal)."""
        if scheme == "normal":
            return full.normal_(0.0, std, generator=gen)
        if name.startswith("b"):
            return full.zero_()
        fan_out, fan_in = full.shape[1:]
        bound = (6.0 / (fan_in + fan_out)) ** 0.5
        return full.uniform_(-bound, bound, generator=gen)


def run_experts(weights: tuple[torch.Tensor, ...], x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The expert MLPs on rows sorted by expert: weights (w1 [e, h, d], b1 [e, h], w2 [e, d, h],
    b2 [e, d]) of e experts, x [N, d], counts[j] rows of expert j -> [N, d]."""
    w1, b1, w2, b2 = weights
    outs = []
    for e, chunk in enumerate(torch.split(x, counts)):
        if chunk.shape[0] == 0:
            continue
        h = F.gelu(F.linear(chunk, w1[e], b1[e]), approximate="tanh")
        outs.append(F.linear(h, w2[e], b2[e]))
    if not outs:
        # no row here: still give every weight a (zero) gradient, so that all ranks reduce the
        # same set of gradients (FSDP2 / DDP / the expert-replica sum must match), and keep the
        # output a function of x: under expert parallelism x came out of an all-to-all whose
        # backward is a collective this rank must join, or its EP peers wait forever
        return x.new_zeros(0, w2.shape[1]) + 0.0 * (x.sum() + sum(w.sum() for w in weights))
    return torch.cat(outs)


def local_dispatch(experts: Experts, x: torch.Tensor, choice: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Run every (token, expert) pair on this rank's experts.

    x: [N, d] one row per (token, chosen expert) pair; choice: [N] expert of each row.
    Returns [N, d] the expert outputs, row for row.
    """
    order = torch.argsort(choice, stable=True)
    counts = torch.bincount(choice, minlength=num_experts).tolist()
    y_sorted = experts(x.index_select(0, order), counts)
    return torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)


class MoEFeedForward(nn.Module):
    """prologue(x) -> router -> top-k experts -> Σ gate·expert(x): [L, dim] -> [L, dim].

    `routing` holds the last forward's `Routing` (read, then cleared, by the loss path).
    `dispatch(experts, rows [N, d], choice [N], E) -> [N, d]` runs the expert MLPs on the
    (token, expert) rows: `local_dispatch` here, an all-to-all one under expert parallelism.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model.moe.top_k={top_k} must be between 1 and model.moe.num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden)
        self.dispatch: Callable[..., torch.Tensor] = local_dispatch
        self.routing: Routing | None = None

    def token_linears(self) -> list:
        """What one token multiplies by (for FLOPs, `.weight.numel()` each): the router and the
        two matrices of each of its top_k experts (expert 0 stands for any)."""
        one = [_Weight(self.experts.w1[0]), _Weight(self.experts.w2[0])]
        return [self.router] + one * self.top_k

    def route(self, h: torch.Tensor) -> Routing:
        """fp32 router logits, probabilities and top-k choices of tokens h [L, dim]."""
        with torch.autocast(h.device.type, enabled=False):
            # a module call (not F.linear on its weight): FSDP2 gathers the router's parameters
            # in its pre-forward hook; they are fp32 (parallelize.router_mp_policy)
            logits = self.router(h.float()).float()
        probs = logits.softmax(dim=-1)
        experts = probs.detach().topk(self.top_k, dim=-1).indices
        return Routing(logits, probs, experts)

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None, rebuild: Prologue | None = None) -> torch.Tensor:
        h = prologue(x) if prologue is not None else x
        L, k = h.shape[0], self.top_k
        routing = self.route(h)
        self.routing = routing
        gates = routing.probs.gather(1, routing.experts)  # [L, k]
        gates = gates / gates.sum(dim=-1, keepdim=True)
        rows = h.repeat_interleave(k, dim=0)  # [L·k, dim], row t·k + j = token t's j-th choice
        y = self.dispatch(self.experts, rows, routing.experts.reshape(-1), self.num_experts)
        y = y.view(L, k, -1) * gates.unsqueeze(-1).to(y.dtype)
        return y.sum(dim=1)


@dataclass
class _Weight:
    """A matmul weight that is not an nn.Linear's (one expert's slice), for counting."""

    weight: torch.Tensor


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE feed-forward layers of a (possibly wrapped) model, in forward order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]
