"""Kernels that torch.compile must not trace, marked without importing torch._dynamo at start.

`torch.compiler.disable` imports torch._dynamo when it decorates: ~1.8 s of CPU at the start of
every process that imports the kernels (a run's launcher, a refused run, `--help`, each tool),
measured with `python -X importtime`, though only `train.compile` runs need it. `eager(fn)`
returns a plain wrapper instead, and `disable_compile()` swaps in `torch.compiler.disable(fn)`
for every marked kernel: `parallel.parallelize.apply_compile` calls it before it compiles a
block, so what torch.compile traces calls the disabled kernel (a graph break, the kernel eager).
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_MARKED: list[list[Callable]] = []  # [kernel as written, what the wrapper calls]


def eager(fn: F) -> F:
    """Mark `fn` to stay out of torch.compile's graphs (see the module docstring)."""
    entry = [fn, fn]
    _MARKED.append(entry)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return entry[1](*args, **kwargs)

    return call  # type: ignore[return-value]


def disable_compile() -> None:
    """`torch.compiler.disable` every kernel marked `eager` (once; imports torch._dynamo)."""
    for entry in _MARKED:
        if entry[1] is entry[0]:
            entry[1] = torch.compiler.disable(entry[0])
