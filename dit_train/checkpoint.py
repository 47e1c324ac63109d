"""Saving the full model: `weights.safetensors` with layout-independent key names."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU state dict; a collective under FSDP (every rank must call it).

    Keys are those of the plain model: wrapper prefixes (DDP `module.`, activation
    checkpointing, torch.compile) are removed by torch.distributed.checkpoint.
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().to(torch.float32, copy=True).contiguous() for k, v in sd.items()}


def export_weights(model: nn.Module, path: str | Path, is_main: bool) -> None:
    from safetensors.torch import save_file

    sd = full_state_dict(model)
    if is_main:
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        save_file(sd, str(tmp))
        tmp.replace(path)  # atomic: a reader never sees half a file
