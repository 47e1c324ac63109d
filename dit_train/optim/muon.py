"""`optim.name=muon`: Muon on the transformer blocks' 2-D weights, AdamW on every other parameter.

Muon (Jordan et al. 2024; torch.optim.Muon) replaces each weight matrix's momentum by its nearest
semi-orthogonal matrix (Newton–Schulz iterations) before the step, so every direction of the
matrix moves at the same rate. On the embedded shapes world it reaches at 2400 steps the held-out
figures AdamW needed 6000 for (docs/quality.md). Embeddings, the final layer, norms, biases and
3-D expert weights keep AdamW, as in the Muon paper and torch's docs.

Layout exactness: the momentum update is elementwise (exact on any shard), but Newton–Schulz
needs the whole matrix, so a sharded (FSDP2 / HSDP DTensor) update is all-gathered over the
parameter's own mesh, orthogonalised identically on every rank, and each rank keeps its shard.
One process and every layout therefore apply the same update (tests/test_layouts.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
# torch.optim.Muon's own Newton–Schulz and learning-rate scaling: its step() works on whatever
# tensor it is given, which for a DTensor shard would orthogonalise the gathered matrix with
# another summation order than one process (and gather inside every matmul)
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from dit_train.sharded import distribute_like, is_dtensor


MUON_EPS = 1e-7  # torch.optim.Muon's Newton–Schulz epsilon (not optim.eps, which is AdamW's)


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """Muon's Newton–Schulz iteration on a [out, in] update -> [out, in]. On CUDA torch's own, in
    bf16 as the Muon paper runs it; on the CPU the same iteration (torch's coefficients, transpose
    and norm) in fp32: a CPU without native bf16 matmuls (AVX2, most laptops) emulates them, measured
    12x slower than fp32 (40 vs 3.3 ms for a 384 x 128 update, one thread), which made a quickstart
    step 2.1 CPU-s against AdamW's 0.36 (0.35 with bf16 hardware). Either way every layout of a run
    orthogonalises the same whole matrix the same way (ShardedMuon)."""
    if update.is_cuda:
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.float().T if tall else update.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose parameters may be DTensors sharded along any mesh (FSDP2, HSDP):
    momentum buffers stay sharded like their parameter; each step all-gathers one update per
    matrix over the parameter's mesh (the same volume as FSDP2's weight all-gather)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                whole = update.full_tensor() if is_dtensor(update) else update
                ortho = orthogonalize(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
                if is_dtensor(p):  # every rank holds the same matrix: keep its own shard, no traffic
                    ortho = distribute_like(ortho, p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(ortho, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two kinds of parameter groups ("muon" and "adamw"), so the LR schedule,
    gradient clipping and checkpoints (DCP's optimizer state dict) see a single optimizer.

    The inner ShardedMuon and AdamW share this optimizer's group dicts and its state dict (their
    parameters are disjoint), and are re-linked after a state dict is loaded."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_params: list[nn.Parameter], lr: float,
                 weight_decay: float, momentum: float, betas: tuple[float, float], eps: float):
        # a side without parameters has no inner optimizer (torch's refuse an empty list)
        self.inner: dict[str, torch.optim.Optimizer] = {}
        if muon_params:
            # match_rms_adamw: Muon's update scaled to AdamW's RMS, so one optim.lr serves both kinds
            self.inner["muon"] = ShardedMuon(muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                             eps=MUON_EPS, adjust_lr_fn="match_rms_adamw")
        if adamw_params:
            # foreach=False: the per-tensor path is bitwise independent of how tensors are grouped
            self.inner["adamw"] = torch.optim.AdamW(adamw_params, lr=lr, betas=betas, eps=eps,
                                                    weight_decay=weight_decay, foreach=False)
        super().__init__([dict(g, kind=kind) for kind, opt in self.inner.items() for g in opt.param_groups],
                         defaults={})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state."""
        for kind, inner in self.inner.items():
            inner.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            inner.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group dicts and the state
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for inner in self.inner.values():
            inner.step()


def muon_split(blocks: nn.Module, params: list[nn.Parameter]) -> tuple[list, list]:
    """(Muon's, AdamW's) share of `params`: the 2-D weights inside `blocks` (the repeated
    transformer blocks) go to Muon, the rest to AdamW."""
    hidden = {id(p) for p in blocks.parameters() if p.ndim == 2}
    return [p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]
