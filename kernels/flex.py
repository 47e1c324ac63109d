"""torch's flex_attention, compiled where that pays (shared by the varlen and block kernels)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def flex_kernel(cuda: bool):
    """flex_attention, compiled on CUDA: called eagerly it runs an unfused reference that
    materialises every [L, L] score (memory and time of the dense mask path); compiled it is one
    fused kernel that skips the blocks the mask leaves empty. On the CPU it stays eager (the
    suite's small packs; compiling costs seconds per new length)."""
    # deferred: it imports torch._dynamo, ~1.8 s at every process's start (kernels/eager.py)
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if cuda else flex_attention
