"""Mixed precision: autocast context and a dynamic loss scale for fp16."""
from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device, fsdp_casts_params: bool):
    """Autocast for bf16/fp16 unless FSDP2's MixedPrecisionPolicy already runs the model in
    that dtype (CUDA). Losses are computed in fp32 by the tasks either way."""
    if precision == "fp32" or fsdp_casts_params:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


class DynamicLossScale:
    """fp16 loss scaling: multiply the loss by `scale`, unscale the gradients, and on a
    non-finite gradient skip the step and halve the scale; after `growth_interval` good steps
    in a row, double it.

    Same rules as torch.amp.GradScaler, but the overflow decision is taken by the caller from
    the *global* gradient norm (all shards, all ranks), so every rank skips the same steps.
    GradScaler's own per-device inf check would look at local FSDP2 shards only.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
