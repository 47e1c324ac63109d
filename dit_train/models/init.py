"""Layout-independent weight initialisation.

Each parameter is drawn from its own generator seeded by (seed, parameter name), on the CPU,
as a full tensor; a sharded parameter (DTensor) then keeps only its local piece. So the
initial weights are the same bits for 1 process, FSDP shards, or a meta-device build, and do
not depend on the order in which modules were created.
"""
from __future__ import annotations

import torch
from torch import nn

from dit_train.models.lora import base_parameters, init_lora_weights_from_seed, is_lora_name, plain_lora_name
from dit_train.models.params import copy_full, named_seed
from dit_train.models.registry import model_spec


def _fill(module: nn.Module, pname: str, full: torch.Tensor, gen: torch.Generator, zero: bool, scheme: str, std: float):
    if hasattr(module, "init_parameter"):  # stacked weights that know their own fan-in (MoE experts)
        return module.init_parameter(pname, full, gen, scheme, std)
    if zero or pname == "bias":
        if scheme == "normal" and not isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return full.normal_(0.0, std, generator=gen)
        return full.zero_()
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return full.fill_(1.0)
    if isinstance(module, nn.Embedding) or scheme == "normal":
        return full.normal_(0.0, std, generator=gen)
    if isinstance(module, nn.Linear):
        fan_out, fan_in = full.shape
        bound = (6.0 / (fan_in + fan_out)) ** 0.5  # xavier uniform, as in DiT
        return full.uniform_(-bound, bound, generator=gen)
    return full.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, scheme: str = "adaln_zero", std: float = 0.02) -> None:
    """Initialise every parameter of `model` in place.

    scheme: "adaln_zero" (DiT: names in `model.zero_init` start at zero, linears xavier) or
    "normal" (every weight N(0, std), nothing zero: all parameters move from the first step,
    which the exactness tests need).
    """
    if scheme not in ("adaln_zero", "normal"):
        raise ValueError(f"model.init={scheme!r} must be adaln_zero or normal")

    zero_patterns = getattr(model, "zero_init", ())
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            if is_lora_name(full_name):
                continue  # adapters: init_lora_weights_from_seed
            # a LoRA-wrapped layer's base weight is seeded under the original name
            name = plain_lora_name(full_name)
            gen = torch.Generator().manual_seed(named_seed(seed, name))
            full = torch.empty(p.shape, dtype=torch.float32)
            zero = scheme == "adaln_zero" and any(z in name for z in zero_patterns)
            _fill(module, pname, full, gen, zero, scheme, std)
            copy_full(p, full)


@torch.no_grad()
def load_full_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (keys = the plain model's parameter names) into `model`, plain or
    sharded (each rank keeps its shard). Every parameter must be given, and nothing else (LoRA
    adapters excepted: they are not in a base model's weights)."""
    params = base_parameters(model)
    missing, unexpected = sorted(params.keys() - state_dict.keys()), sorted(state_dict.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"pretrained weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        if tuple(state_dict[name].shape) != tuple(p.shape):
            raise ValueError(f"pretrained {name} has shape {tuple(state_dict[name].shape)}, the model {tuple(p.shape)}")
        copy_full(p, state_dict[name])


def initialize(model: nn.Module, cfg, seed: int) -> None:
    """Initial weights of a built (possibly sharded) model in one process: the model's
    pretrained weights when its config names a folder (`model.pretrained`, models whose spec can
    read one), else `init_weights` from the seed; LoRA adapters, if any, from the seed too.
    (Across ranks, engine/build.py reads pretrained weights on rank 0 and broadcasts them.)"""
    spec = model_spec(cfg)
    if spec.pretrained is not None and getattr(cfg, "pretrained", ""):
        load_full_weights(model, spec.pretrained(cfg))
    else:
        init_weights(model, seed, cfg.init)
    init_adapters(model, seed)


def init_adapters(model: nn.Module, seed: int) -> None:
    """LoRA adapters from (seed, name), when the model has any."""
    if hasattr(model, "peft_config"):
        init_lora_weights_from_seed(model, seed)
