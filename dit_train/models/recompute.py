"""Linear layers whose input is recomputed in backward instead of saved.

A `Linear` saves its input for the weight gradient. When that input is a cheap elementwise
function of tensors autograd keeps anyway — LayerNorm/RMSNorm of the residual stream, adaLN's
modulate, the MLP's GELU — saving it costs one [L, d] (or [L, h]) activation per block that
one elementwise pass in backward can rebuild. `recomputed_linear(linear, Prologue(fn, args), x)`
computes `linear(fn(x, *args))`, saves only x, args and the weight, and in backward re-runs
`fn` (under the forward's autocast state) before the weight and input gradients.

Exact: the forward runs the very same ops; the backward uses the formulas autograd uses for
`addmm`/`mm` (input grad g·W, weight grad gᵀ·a, bias grad g summed over tokens, each in the
dtype autocast computed the matmul in, then cast back like autocast's `_to_copy`), and `fn`'s
own backward through autograd — bit-identical values and gradients in fp32 and fp64
(tests/test_recompute.py compares with the plain modules).

Falls back to the plain `linear(fn(x, *args))` where the trick does not apply: a wrapped
linear (LoRA adapters), torch.compile (its partitioner already recomputes elementwise ops and
it cannot trace the nested autograd call), gradients off, non-2-D inputs.

A switch, `model.recompute_prologues`: the rebuild costs an elementwise pass or a norm per
linear in backward (a few % of a CPU step, docs/performance.md), so it is a memory option like
activation checkpointing. Modules whose forward is decorated with `prologue_switch` (the
blocks, the DiT's final layer) read their `recompute_prologues` attribute, which
`set_recompute_prologues` sets from the config when the model is built; off runs the composite
ops (`composite_ops`), the same values and gradients bit for bit.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


_FUSED = [True]


@contextlib.contextmanager
def composite_ops() -> Iterator[None]:
    """Run `recomputed_linear` and `fused.gated_residual` as the plain composite ops (the
    input saved, the gathers kept): the reference the exactness tests and the activation
    benchmark's before/after rows compare with. Wins over any module's switch inside it."""
    _FUSED.append(False)
    try:
        yield
    finally:
        _FUSED.pop()


def fused_enabled() -> bool:
    return _FUSED[-1]


def prologue_switch(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Decorator of a module's `forward`: runs it with the recomputed prologues (and the fused
    gated residual) on or off as the module's `recompute_prologues` attribute says
    (`model.recompute_prologues`, set by `set_recompute_prologues`). Off = the composite ops:
    the same values and gradients bit for bit, more saved for backward, less recomputed.
    On the block's forward, so that activation checkpointing's re-run of the block in
    backward makes the same choice as its forward."""

    @functools.wraps(forward)
    def switched(self, *args, **kwargs):
        _FUSED.append(self.recompute_prologues and _FUSED[-1])
        try:
            return forward(self, *args, **kwargs)
        finally:
            _FUSED.pop()

    return switched


def set_recompute_prologues(model: nn.Module, on: bool) -> nn.Module:
    """Switch the recomputed prologues of every module of `model` that has them (the DiT and
    LM blocks, the DiT's final layer; `model.recompute_prologues`). Returns `model`."""
    for m in model.modules():
        if hasattr(m, "recompute_prologues"):
            m.recompute_prologues = bool(on)
    return model


@dataclass
class Prologue:
    """`fn(x, *args)`: an elementwise map in front of a linear layer. `args` are tensors
    (parameters, per-sample tables, indices): they are saved and get their gradients through
    the fused op, so parameters must be passed here, never captured by `fn`."""

    fn: Callable[..., torch.Tensor]
    args: tuple = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, *self.args)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _RecomputedInputLinear(torch.autograd.Function):
    """y = F.linear(fn(x, *args), weight, bias); saves x, args and weight, not fn's output.
    With `rebuild` (x == rebuild(*rebuild_args) exactly), saves rebuild_args instead of x."""

    @staticmethod
    def forward(ctx, fn, rebuild, n_args, weight, bias, x, *rest):
        args, rebuild_args = rest[:n_args], rest[n_args:]
        a = fn(x, *args)
        y = torch.nn.functional.linear(a, weight, bias)  # autocast (if on) casts a, weight, bias as usual
        ctx.fn, ctx.rebuild, ctx.n_args = fn, rebuild, n_args
        ctx.autocast = (a.device.type, *_autocast_state(a.device.type))
        ctx.compute_dtype = y.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, bias, *((x, *args) if rebuild is None else (*args, *rebuild_args)))
        return y

    @staticmethod
    def backward(ctx, g):
        weight, bias, *saved = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        autocast = torch.autocast(device_type, dtype=dtype, enabled=enabled)
        if ctx.rebuild is None:
            inputs = saved
        else:
            with torch.no_grad(), autocast:
                x = ctx.rebuild(*saved[ctx.n_args:])
            inputs = [x, *saved[:ctx.n_args]]
        need_in = [isinstance(t, torch.Tensor) and t.is_floating_point() and n
                   for t, n in zip(inputs, ctx.needs_input_grad[5:])]
        with torch.enable_grad(), autocast:
            xs = [t.detach().requires_grad_() if n else t for t, n in zip(inputs, need_in)]
            a = ctx.fn(*xs)
        cd = ctx.compute_dtype
        a_c = a.detach().to(cd)  # the matmul's saved input as autocast made it (no copy without autocast)
        w_c = weight.to(cd)
        # addmm/mm backward (torch/csrc/autograd/FunctionsManual.cpp mm_mat1/mat2_backward for a
        # row-major input and a transposed weight): d input = g·W, d weight = gᵀ·a
        dw = g.t().mm(a_c).to(weight.dtype) if ctx.needs_input_grad[3] else None
        db = g.sum_to_size(bias.shape).to(bias.dtype) if ctx.has_bias and ctx.needs_input_grad[4] else None
        grads = [None] * len(inputs)
        if any(need_in):
            da = g.mm(w_c).to(a.dtype)
            wanted = [x for x, n in zip(xs, need_in) if n]
            got = iter(torch.autograd.grad(a, wanted, da, allow_unused=True))
            grads = [next(got) if n else None for n in need_in]
        n_rebuild = len(ctx.needs_input_grad) - 6 - ctx.n_args
        return None, None, None, dw, db, *grads, *([None] * n_rebuild)


def recomputed_linear(linear: nn.Module, prologue: Prologue | None, x: torch.Tensor,
                      rebuild: Prologue | None = None) -> torch.Tensor:
    """`linear(prologue(x))` without saving `prologue(x)` for backward (see the module doc).
    x: [L, in] -> [L, out].

    rebuild: x == rebuild.fn(*rebuild.args) bit for bit (e.g. a residual x0 + gate·y whose
    operands are saved anyway): then x itself is not saved either, backward recomputes it.
    Gradients still flow to x only (not to rebuild's args), as without it."""
    if prologue is None:
        return linear(x)
    plain = (type(linear) is not nn.Linear or x.dim() != 2 or not torch.is_grad_enabled()
             or torch.compiler.is_compiling() or not fused_enabled())
    if plain:
        return linear(prologue(x))
    extra = () if rebuild is None else rebuild.args
    return _RecomputedInputLinear.apply(prologue.fn, None if rebuild is None else rebuild.fn, len(prologue.args),
                                        linear.weight, linear.bias, x, *prologue.args, *extra)
