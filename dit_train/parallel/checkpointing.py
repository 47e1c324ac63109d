"""Activation checkpointing policies: which blocks recompute what in backward.

`model.activation_checkpointing` picks the policy, `model.ac_every` = k applies it to every
k-th block only (blocks k-1, 2k-1, ...: 1 = all, 2 = every second one); the other blocks
keep their activations. Every policy is exact (backward recomputes the same ops on the same
inputs; the RNG is not used in a block's forward, so its state need not be kept):

  none       every block keeps what autograd saves.
  full       a checkpointed block keeps only its inputs and reruns its whole forward in
             backward (about one more forward per step: ~+30% compute).
  selective  torch's selective checkpointing (`create_selective_checkpoint_contexts`): the
             outputs of the expensive ops are kept — matmuls (mm/addmm/bmm/baddbmm),
             attention kernels (SDPA's flash/efficient/cuDNN/CPU-flash, flash-attn's varlen)
             and the context-parallel all-to-alls (so backward sends nothing twice) — and the
             cheap elementwise ops between them (norms, modulation, RoPE, GELU, residuals)
             are recomputed: a few percent of compute for a memory between none and full.

Booleans are accepted as the policy's aliases (users' `model.activation_checkpointing=true`):
true = full, false = none (`ac_policy`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from dit_train.config.choices import ActivationCheckpointing


def ac_policy(value: Any) -> str:
    """The policy name of a config value: a policy name, or a bool alias (true = full)."""
    return ActivationCheckpointing.of(value)


def checkpointed_blocks(depth: int, every: int) -> list[int]:
    """Indices of the blocks a policy applies to with `model.ac_every=every`."""
    return [i for i in range(depth) if (i + 1) % max(1, every) == 0]


def _optional_ops(names: list[str]) -> list[Any]:
    """The op overloads among `names` ('namespace.op.overload') that this torch build has."""
    out = []
    for name in names:
        ns, op, overload = name.split(".")
        try:
            out.append(getattr(getattr(getattr(torch.ops, ns), op), overload))
        except (AttributeError, RuntimeError):
            continue
    return out


@functools.lru_cache(maxsize=None)
def selective_save_ops() -> tuple[Any, ...]:
    """Ops whose outputs selective checkpointing keeps (everything else is recomputed)."""
    return tuple(_optional_ops([
        "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._efficient_attention_forward.default", "aten._flash_attention_forward.default",
        "flash_attn._flash_attn_varlen_forward.default", "flash_attn._flash_attn_forward.default",
        "_c10d_functional.all_to_all_single.default",
    ]))


def _selective_contexts():
    return create_selective_checkpoint_contexts(list(selective_save_ops()))


def apply_activation_checkpointing(blocks: nn.ModuleList, policy: Any = "full", every: int = 1) -> None:
    """Wrap the blocks `policy` and `every` select (in place, in the ModuleList), before FSDP
    and compile wrap them. Non-reentrant checkpointing (works with FSDP2's hooks)."""
    policy = ac_policy(policy)
    if policy == "none":
        return
    extra = {"context_fn": _selective_contexts} if policy == "selective" else {}
    for i in checkpointed_blocks(len(blocks), every):
        blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=False, **extra)
