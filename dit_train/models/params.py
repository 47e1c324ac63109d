"""Parameters by their plain names: what initialisation (init.py), LoRA (lora.py) and the EMA
share. A plain name has the parts that wrappers add (activation checkpointing, torch.compile)
removed, so seeds and pretrained keys do not depend on how a model was wrapped; a full tensor is
copied into a parameter, or into its local shard when the parameter is a DTensor."""
from __future__ import annotations

import hashlib

import torch

from dit_train.sharded import distribute_like, is_dtensor

# Name parts added by wrappers that parallelize() may apply before initialisation (meta_init):
# activation checkpointing and torch.compile. Seeds and pretrained keys use the plain names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def named_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def copy_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into parameter p, or into p's local shard if p is a DTensor."""
    if is_dtensor(p):
        full = distribute_like(full, p)  # every rank holds the same full tensor: slice locally, no comms
    p.copy_(full.to(device=p.device, dtype=p.dtype))
