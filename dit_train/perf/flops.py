"""Training FLOPs of one step of the packed DiT / LM (model FLOPs: recomputation not counted).

Per token, every matmul weight W (a × b) costs 2·a·b FLOPs forward and 4·a·b backward
(grad of input and of weight): 6·N_tok per token, N_tok = `ModelShape.params_per_token`
(qkv, proj, fc1, fc2 of every block + patch embedding and output projection; adaLN runs once
per sample and the embedding lookup is free, so they are left out).

Attention is varlen: a sample of T_b tokens attends to its own T_b keys only, so per layer
QKᵀ costs 2·T_b²·d and PV another 2·T_b²·d forward (d = heads·head_dim), 2× that backward:
    attention = 3 · 4 · d · depth · Σ_b T_b²        (halved for causal masks)
    total     = 6 · N_tok · Σ_b T_b  +  attention
MFU = total / (step time · peak FLOP/s); H100 SXM dense bf16 peak = 989 TFLOP/s.
"""
from __future__ import annotations

from typing import Sequence

from dit_train.perf.memory import ModelShape

PEAK_TFLOPS = {"h100_bf16": 989.0, "h100_tf32": 494.5, "h200_bf16": 989.0, "a100_bf16": 312.0}


def attention_flops(shape: ModelShape, seqlens: Sequence[int], causal: bool = False) -> float:
    """Forward + backward FLOPs of all attention score/value products for one micro-batch."""
    f = 3 * 4 * shape.dim * shape.depth * sum(int(t) * int(t) for t in seqlens)
    return f / 2 if causal else f


def train_flops(shape: ModelShape, seqlens: Sequence[int], causal: bool = False) -> float:
    """Forward + backward FLOPs of one micro-batch whose samples have `seqlens` tokens."""
    return 6.0 * shape.params_per_token * sum(int(t) for t in seqlens) + attention_flops(shape, seqlens, causal)


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    return flops / max(seconds, 1e-12) / (peak_tflops * 1e12)
