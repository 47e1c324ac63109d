"""The time model train.balance=cost places samples by (data_pipelines/packing.StepCost).

One micro-batch on one rank costs

    micro_s + Σ_b [ sample_s + (6·N_tok·T_b)·r / (cp·linear_flops) + (12·d·depth·T_b²)·r / (cp·attention_flops) ]

seconds: the FLOP model of perf/flops.py (`train_flops` = linear + `attention_flops`, halved
for causal masks) with the model's real shapes (`memory.model_shape`), each part at its own
achieved speed (attention kernels run at a different FLOP/s than the matmuls, and on CPUs much
slower), divided over the CP group (Ulysses and ring give each CP rank 1/cp of every sample's
work), times r = 1 + (checkpointed blocks / depth)/3 under full activation checkpointing (the
forward, a third of a block's FLOPs, runs twice; selective recomputes only elementwise ops).
sample_s and micro_s are what the FLOPs miss: per-sample kernels (adaLN, one SDPA call per
run of equal lengths) and per-micro-batch work (the loss, FSDP's gathers).

The speeds are constants per device type, so every rank computes the same plan (a speed
measured at run time would differ between ranks and break the step plan's agreement):
`SPEEDS["cpu"]` is fitted to measured CPU step times (`python -m dit_train.tools.bench_balance
--calibrate`, docs/performance.md); `SPEEDS["cuda"]` is an assumption (matmuls at ~55% and
attention at ~45% of an H100's dense bf16 peak) until a GPU run calibrates it. Only the ratios
matter for placement: the absolute seconds are for the tables.
"""
from __future__ import annotations

from dataclasses import dataclass

from dit_train.config.choices import ActivationCheckpointing
from dit_train.data_pipelines.packing import StepCost
from dit_train.perf.flops import attention_flops, train_flops
from dit_train.perf.memory import ModelShape, ac_split


@dataclass(frozen=True)
class DeviceSpeed:
    """Achieved speeds of one device type (FLOP/s, seconds)."""

    linear_flops: float  # FLOP/s on the matmuls applied to every token (6·N_tok·T)
    attention_flops: float  # FLOP/s on the score and value products (12·d·depth·T², varlen)
    sample_s: float = 0.0  # seconds per sample of a micro-batch beyond its FLOPs
    micro_s: float = 0.0  # seconds per micro-batch beyond its samples (an empty one costs this)


SPEEDS = {
    # fitted on this repository's 2-core CPU machine (fp32, one thread per rank; the mean of two
    # `tools.bench_balance --calibrate` fits, each within ±15% of every pack): the tiny DiT of
    # tools.bench_balance (dim 64, depth 2, 4 heads), packs of 1-16 samples of 64-2048 tokens. The
    # CPU's flash SDPA runs faster per FLOP than these narrow (64-wide) matmuls
    "cpu": DeviceSpeed(linear_flops=3.3e10, attention_flops=5.3e10, sample_s=5e-4, micro_s=1e-2),
    # assumed, not measured (no GPU run has calibrated it): ~55% / ~45% of 989 TFLOP/s bf16
    "cuda": DeviceSpeed(linear_flops=5.4e14, attention_flops=4.5e14, sample_s=2e-5, micro_s=2e-3),
}


def recompute_factor(depth: int, checkpointing: str, every: int = 1) -> float:
    """FLOPs actually run / model FLOPs: full checkpointing runs a checkpointed block's forward
    (1/3 of its forward + backward) twice; selective recomputes elementwise ops only."""
    if ActivationCheckpointing.of(checkpointing) != "full":
        return 1.0
    n_ckpt, _ = ac_split(depth, every)
    return 1.0 + n_ckpt / max(1, depth) / 3.0


def step_cost(shape: ModelShape, speed: DeviceSpeed, *, cp: int = 1, checkpointing: str = "none", ac_every: int = 1,
              causal: bool = False, lockstep: bool = False) -> StepCost:
    """The StepCost of one rank for a model of `shape` on a device of `speed`, under a CP
    degree `cp` (cp_ulysses · cp_ring) and the model's activation checkpointing; lockstep:
    the DP ranks meet at every micro-batch (StepCost.lockstep)."""
    r = recompute_factor(shape.depth, checkpointing, ac_every) / cp
    attn = attention_flops(shape, [1], causal)  # per T_b²
    linear = train_flops(shape, [1], causal) - attn  # per T_b
    return StepCost(per_token=linear * r / speed.linear_flops, per_sq_token=attn * r / speed.attention_flops,
                    per_sample=speed.sample_s / cp, per_micro=speed.micro_s, lockstep=lockstep)


def run_cost(shape: ModelShape, model_cfg, parallel_cfg, device_type: str, causal: bool = False) -> StepCost:
    """step_cost for a run: its model's checkpointing, its CP degree, its device type's speed
    (an unknown type: CUDA's). Lockstep when FSDP2 shards over DP ranks (each layer's all-gather
    in every micro-batch waits for all of them); DDP, dp_mode=none and pure replicas meet only
    at the gradient reduce."""
    lockstep = parallel_cfg.dp_mode == "fsdp2" and parallel_cfg.dp_shard > 1
    return step_cost(shape, SPEEDS.get(device_type, SPEEDS["cuda"]), cp=parallel_cfg.cp_ulysses * parallel_cfg.cp_ring,
                     checkpointing=model_cfg.activation_checkpointing, ac_every=model_cfg.ac_every, causal=causal,
                     lockstep=lockstep)
