"""Does a LoRA run fit on my card? The one-process planner of `tools.plan --frames ... --gpu-mem-gib G`
for LoRA configs (model.lora.rank > 0) on one rank: it chooses model.base_quant, model.block_swap
and activation checkpointing, and models the swap's step-time cost.

Per-term device bytes of one clip of T tokens (one micro-batch), c = bytes of the compute dtype:

    base          frozen block weights on the device: (depth - N + min(N, 2)) blocks x params_block x q
                  (q = QUANT_BYTES: 4 for an unquantized base, which keeps fp32 storage; 1 for int8 /
                  fp8, torchao's weight-only tensors, per-row scales ignored; 1.06 for fp8_scaled;
                  0.52 for nf4), + params outside the blocks x 4
    autocast      bf16/fp16 without quantization: autocast's c-byte copies of the resident block
                  weights (perf/memory.py's autocast_weight_cache; a quantized weight is dequantized
                  per use instead, transient)
    adapters      LoRA parameters x (4 weight + 4 gradient + optimizer state) (+4 EMA)
    activations   perf/memory.activation_parts (saved + one block's recompute), attention workspace
    reserve       allocator / CUDA context
    host          N swapped blocks x params_block x q (pinned) + offloaded activations

N = model.block_swap: at most two swapped blocks are on the device at once
(dit_train/engine/block_swap.py). An option fits when its device terms fit the card and its host
bytes the host memory. Options, cheapest first (ORDER below): no quantization before 8-bit
(int8) before nf4, no swap before swap, no checkpointing before full, no activation offload
(train.activation_offload: the saved block inputs in host memory) before offload; block swap and
offload come with full checkpointing. The first option that fits wins: (4-bit, offload,
block_swap, quantization, checkpointing) lexicographic — nf4 only where no 8-bit option fits,
with any swap and offload.

Swap cost: each swapped block is copied twice a step (ahead of its forward and of its backward),
params_block x q bytes at `h2d_bytes_per_s`; the copy of block k + 1 runs while block k computes,
so what shows is max(0, copy - compute) per copy. Compute per block: the FLOP model of
perf/flops.py for a LoRA step (frozen weights: no weight gradient, 4/6 of 6·N·T, plus the recompute
of full checkpointing: forward 2·N·T again) at `flops_per_s` achieved.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dit_train.models.quant import FP8_GROUP, NF4_BLOCK, NF4_SCALER_BLOCK
from dit_train.perf.flops import attention_flops
from dit_train.perf.memory import (DTYPE_BYTES, GIB, ModelShape, activation_parts, attention_workspace_bytes,
                                   offloaded_activation_bytes, optimizer_bytes_per_param)

# bytes per frozen block weight, from models/quant.py's block sizes: fp8_scaled an fp32 scale per
# FP8_GROUP inputs; nf4 4-bit codes, an int8 absmax per NF4_BLOCK values and an fp32 factor per
# NF4_SCALER_BLOCK absmaxes.
QUANT_BYTES = {"none": 4.0, "int8": 1.0, "fp8": 1.0, "fp8_scaled": 1.0 + 4 / FP8_GROUP,
               "nf4": 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)}

# The quantizations `options` walks by default, in the order of what they cost a run (measured,
# docs/one-gpu.md): none; int8 — the smallest error of the 8-bit forms (a 100-step LoRA's loss
# drift from the full base 2.1e-3, fp8_scaled 6.5e-3, fp8 1.9e-2) and the fastest of them on the
# CPU (benchmarks/quant_linear_cpu.py); nf4 last — ~0.52 B per weight, but 5.9e-2 drift, 13-18x
# int8's adapter-gradient error, and 2.2-3.9x a plain linear's time on the CPU against int8's
# 1.0-1.4x (dequantized on every use). fp8 (int8's bytes) and fp8_scaled (1.06 B) are never the first to fit after int8 — more
# bytes or as many, more error — so they are walked only when asked for (`quants`, tools.plan
# --base-quants, e.g. where int8 does not run or for musubi-tuner's format).
DEFAULT_QUANTS = ("none", "int8", "nf4")
# Why nf4 comes after block swap and activation offload rather than before: those two move values
# without changing them (block swap bit-equal to no swap, tests/test_block_swap.py) and cost only
# time, and a swapped block's copy hides behind the previous block's compute on long clips
# (swap_exposed_s); nf4 costs every step its dequantization and the run its precision. With all
# blocks swapped nf4 saves little device memory (half of the two resident blocks' int8 bytes):
# where it is chosen is mostly a pinned host budget too small for the 8-bit swapped blocks
# (host_capacity: pinned bytes only; the build's transient full-precision copy of the model in
# host memory, 4 B per weight before quantization, is not counted).
ORDER = ("none", "int8", "fp8_scaled", "fp8", "nf4")  # cost to the result, measured as above
FOUR_BIT = ("nf4",)


@dataclass
class OneGpuOption:
    base_quant: str
    block_swap: int
    checkpointing: str
    activation_offload: bool = False  # train.activation_offload
    terms: dict[str, float] = field(default_factory=dict)  # device bytes by term
    host: float = 0.0  # pinned host bytes of the swapped blocks
    swap_copy_s: float = 0.0  # seconds of host-to-device copies per step
    swap_exposed_s: float = 0.0  # of which not hidden behind compute
    compute_s: float = 0.0  # modelled compute seconds per step
    capacity: float = 0.0
    host_capacity: float = float("inf")

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity and self.host <= self.host_capacity

    def overrides(self) -> list[str]:
        return [f"model.base_quant={self.base_quant}", f"model.block_swap={self.block_swap}",
                f"model.activation_checkpointing={self.checkpointing}"] + ["train.activation_offload=true"] * self.activation_offload

    def row(self) -> dict[str, Any]:
        return {"base_quant": self.base_quant, "block_swap": self.block_swap, "ac": self.checkpointing,
                "act_offload": self.activation_offload,
                **{f"{k}_GiB": round(v / GIB, 2) for k, v in self.terms.items()}, "total_GiB": round(self.total / GIB, 2),
                "host_GiB": round(self.host / GIB, 2), "swap_copy_s": round(self.swap_copy_s, 3),
                "swap_exposed_s": round(self.swap_exposed_s, 3), "compute_s": round(self.compute_s, 3),
                "fits": self.fits}


def lora_compute_s(s: ModelShape, tokens: int, checkpointing: str, flops_per_s: float) -> float:
    """Modelled seconds of one LoRA step on one clip (frozen base: no weight gradients)."""
    linear = 2.0 * s.params_per_token * tokens  # one forward
    attn = attention_flops(s, [tokens]) / 3.0  # attention_flops counts forward + backward (x3)
    forward = linear + attn
    total = forward * 3.0 - 2.0 * s.params_per_token * tokens  # fwd + bwd (2x fwd) minus the weight gradients
    if checkpointing == "full":
        total += forward
    return total / flops_per_s


def estimate(s: ModelShape, adapter_params: int, tokens: int, *, base_quant: str, block_swap: int, checkpointing: str,
             activation_offload: bool = False, precision: str, optimizer: str, ema: bool, backend: str, capacity: float, reserve: float,
             h2d_bytes_per_s: float, flops_per_s: float, host_capacity: float = float("inf")) -> OneGpuOption:
    """The device terms, host bytes and swap cost of one option (see the module docstring)."""
    q = QUANT_BYTES[base_quant]
    c = DTYPE_BYTES[precision]
    resident = s.depth - block_swap + min(block_swap, 2)
    block_bytes = s.params_block * q
    saved, recompute = activation_parts(s, tokens, precision, checkpointing, 1, 1, 1, activation_offload, backend, tokens)
    offloaded = offloaded_activation_bytes(s, tokens, precision, checkpointing, 1, 1, 1, backend, tokens) if activation_offload else 0.0
    terms = {
        "base": resident * block_bytes + 4.0 * s.params_other,
        "adapters": adapter_params * (8.0 + optimizer_bytes_per_param(optimizer) + (4.0 if ema else 0.0)),
        "activations": saved + recompute,
        "attention_workspace": attention_workspace_bytes(s, backend, tokens, precision, 1, 1),
        "reserve": reserve,
    }
    if base_quant == "none" and precision != "fp32":
        terms["autocast"] = max(0.0, c * resident * s.params_block - recompute)
    compute = lora_compute_s(s, tokens, checkpointing, flops_per_s)
    copy = block_bytes / h2d_bytes_per_s
    # per block: forward is 2 of the 6 (+2 recompute) compute units, backward the rest
    units = 8.0 if checkpointing == "full" else 6.0
    fwd, bwd = compute / s.depth * 2.0 / units, compute / s.depth * (units - 2.0) / units
    exposed = block_swap * (max(0.0, copy - fwd) + max(0.0, copy - bwd))
    # activation offload: what forward saves goes to the host and comes back once, on the same link;
    # counted as not hidden (an upper bound: its copies overlap compute too)
    act_copy = 2.0 * offloaded / h2d_bytes_per_s
    return OneGpuOption(base_quant, block_swap, checkpointing, activation_offload, terms,
                        host=block_swap * block_bytes + offloaded, swap_copy_s=2 * block_swap * copy + act_copy,
                        swap_exposed_s=exposed + act_copy, compute_s=compute, capacity=capacity,
                        host_capacity=host_capacity)


def options(s: ModelShape, adapter_params: int, tokens: int, quants: tuple[str, ...] = DEFAULT_QUANTS,
            **kw: Any) -> list[OneGpuOption]:
    """Every (4-bit, activation offload, block_swap, base_quant, checkpointing) option of the
    model.base_quant values `quants` (walked in ORDER whatever their order here), cheapest first
    (module docstring, DEFAULT_QUANTS)."""
    unknown = set(quants) - set(ORDER)
    if unknown:
        raise ValueError(f"unknown model.base_quant {sorted(unknown)}: one of {', '.join(ORDER)}")
    walked = [q for q in ORDER if q in quants]
    out = []
    for tier in ([q for q in walked if q not in FOUR_BIT], [q for q in walked if q in FOUR_BIT]):
        for offload in (False, True):
            for n in range(s.depth + 1):
                for quant in tier:
                    for ac in (("none", "full") if n == 0 and not offload else ("full",)):
                        out.append(estimate(s, adapter_params, tokens, base_quant=quant, block_swap=n, checkpointing=ac,
                                            activation_offload=offload, **kw))
    return out


def choose(opts: list[OneGpuOption]) -> OneGpuOption | None:
    """The first option that fits (they come cheapest first), or None."""
    return next((o for o in opts if o.fits), None)
