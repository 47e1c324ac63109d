"""`optim.name=adamw8bit`: AdamW with 8-bit moments, torchao's `torchao.optim.AdamW8bit`.

Each moment tensor of >= 4096 values (a multiple of 256) is stored as uint8 codes in blocks of
256 values with one fp32 scale per block (dynamic-tree quantization maps, bitsandbytes'
scheme): ~2.03 B per parameter for both moments instead of AdamW's 8. Smaller tensors (biases,
norms, small adapters) keep fp32 moments, as bitsandbytes does. The update itself is computed
in fp32 per parameter (torchao compiles it with torch.compile, once per shape).

Checkpoints: the moments are torchao tensor subclasses (`OptimState8bit`: codes, scales, the
code map) that DCP writes and reads as they are (no dequantize / requantize), so a resumed run
continues with the same codes: bit-equal to the uninterrupted run (tests/test_low_bit_optim.py).

Layouts: one process only (several ranks are refused in engine/checks.py). Under FSDP2 torchao
quantizes each rank's local shard in its own 256-value blocks and keeps shards under 4096 values
in fp32, so the states (and the updates) would depend on how a parameter is sharded. DDP and
dp_replicate hold whole parameters, but the gradient sum's order flips 8-bit codes at rounding
boundaries and Adam carries the flips: measured from 2.5e-5 to 1.0e-2 of the update between runs
of the same 3-step test (docs/one-gpu.md), as far as FSDP2 sharding's 1.05e-2: refused too.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

BLOCK = 256  # values per scale (torchao's default for AdamW8bit)
MIN_NUMEL = 4096  # torchao quantizes a moment from this many values (bitsandbytes' threshold)
# bytes per parameter of both moments: 2 uint8 codes + 2 fp32 scales per BLOCK values
QUANTIZED_BYTES = 2 + 2 * 4 / BLOCK


def adamw8bit(params: Iterable[nn.Parameter], lr: float, betas: tuple[float, float], eps: float,
              weight_decay: float) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit  # deferred: optional (the quant extra)

    return AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=BLOCK)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold (a torchao state: its codes and scales; the
    shared code map is not counted)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if not isinstance(v, torch.Tensor):
                continue
            parts = [getattr(v, n) for n in ("codes", "scale")] if hasattr(v, "codes") else [v]
            total += sum(t.numel() * t.element_size() for t in parts)
    return total


@functools.lru_cache(maxsize=None)
def probe(device: str) -> str:
    """'' if torchao's AdamW8bit steps a quantized-state parameter on `device` here (its update
    is torch.compile'd: a missing compiler toolchain fails here, not in the workers), else the
    reason (one line)."""
    try:
        import torchao.optim  # noqa: F401
    except ImportError as exc:
        return (f"optim.name=adamw8bit needs torchao ({exc}); install it: pip install 'dit_train[quant]' "
                f"(or pip install torchao), or set optim.name=adamw")
    try:
        p = nn.Parameter(torch.zeros(MIN_NUMEL, device=device))
        opt = adamw8bit([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        p.grad = torch.ones_like(p)
        opt.step()
        if not bool(torch.isfinite(p).all()):
            raise RuntimeError("the step gave non-finite weights")
    except Exception as exc:  # any backend or compiler failure means: it cannot run here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"optim.name=adamw8bit: torchao's AdamW8bit cannot step on {device} here ({first[:160]}); "
                f"set optim.name=adamw")
    return ""
