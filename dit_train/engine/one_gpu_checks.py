"""Pre-run checks of the one-GPU settings (docs/one-gpu.md): a quantized frozen base
(model.base_quant), block swap (model.block_swap) and 8-bit optimizer states (optim.name=adamw8bit).
Part of engine/checks.py's `check_config`; each error says what to change."""
from __future__ import annotations

from typing import Any

import torch

from dit_train.config import Config
from dit_train.config.choices import ActivationCheckpointing
from dit_train.config.errors import check
from dit_train.models import build_model, model_spec, quant
from dit_train.models.lora import apply_lora, lora_settings
from dit_train.optim import low_bit
from dit_train.parallel.checkpointing import checkpointed_blocks
from dit_train.parallel.mesh import ParallelDims


def one_gpu_errors(cfg: Config) -> list[str]:
    """Every problem of model.base_quant, model.block_swap and optim.name=adamw8bit in cfg."""
    e: list[str] = []
    _base_quant(cfg, e)
    _block_swap(cfg, e)
    _low_bit_optim(cfg, e)
    return e


def runs_on_cuda(device: str) -> bool:
    """Whether parallel.device (auto | cpu | cuda) puts the run on a GPU on this machine."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _base_quant(cfg: Config, e: list[str]) -> None:
    """model.base_quant: only under LoRA (a quantized weight gets no gradient: full training of it
    is not supported), and only where torchao runs that quantization on this run's device (a
    small linear is quantized and run forward and backward there: a missing torchao or a kernel
    the device lacks is one line here, not a failure inside the workers)."""
    kind = str(cfg.model.base_quant)
    if kind == "none":
        return
    if cfg.model.lora.rank <= 0:
        e.append(f"model.base_quant={kind} quantizes the frozen base of a LoRA run; full training of a quantized "
                 f"base is not supported: set model.lora.rank (e.g. 16) or model.base_quant=none")
        return
    reason = quant.probe(kind, "cuda" if runs_on_cuda(cfg.parallel.device) else "cpu")
    check(not reason, reason, e)
    if kind in ("nf4", "fp8_scaled") and not reason:
        e.extend(_blocked_quant_errors(cfg.model, kind))


def _blocked_quant_errors(m: Any, kind: str) -> list[str]:
    """model.base_quant=nf4 | fp8_scaled: every weight quantize_base would store (the frozen linears
    of the blocks once LoRA is injected; the model built on the meta device) splits into its blocks."""
    try:
        with torch.device("meta"):
            model = build_model(m)
            apply_lora(model, lora_settings(m), model_spec(m).name)
    except Exception:  # the model's and LoRA's own checks report what is wrong with them
        return []
    frozen = set(quant.frozen_linears(model_spec(m).blocks(model)))
    reason = quant.unfit(kind, ((n, mod) for n, mod in model.named_modules() if mod in frozen))
    return [reason] if reason else []


def _block_swap(cfg: Config, e: list[str]) -> None:
    """model.block_swap=N (dit_train/engine/block_swap.py): N of model.depth blocks, a LoRA run
    (only frozen weights move), full activation checkpointing on the swapped (last N) blocks
    (without it the saved views of the weights keep every device copy alive until backward), and
    one process (FSDP2 swaps parameter storage itself: parallel.cpu_offload there)."""
    m, p = cfg.model, cfg.parallel
    n = m.block_swap
    if n == 0:
        return
    if not 0 <= n <= m.depth:
        e.append(f"model.block_swap={n} must be between 0 and model.depth={m.depth} (the blocks whose frozen weights "
                 f"stay in host memory)")
        return
    check(m.lora.rank > 0, f"model.block_swap={n} streams frozen weights; with model.lora.rank=0 every weight trains: "
           f"set model.lora.rank (e.g. 16) or model.block_swap=0", e)
    swapped = set(range(m.depth - n, m.depth))
    try:
        policy = ActivationCheckpointing.of(m.activation_checkpointing)
    except ValueError:
        return  # reported by _parallel
    covered = policy == "full" and swapped <= set(checkpointed_blocks(m.depth, max(1, m.ac_every)))
    check(covered, f"model.block_swap={n} needs full activation checkpointing on the swapped blocks: set "
           f"model.activation_checkpointing=full model.ac_every=1 (now {policy}, every {m.ac_every})", e)
    world = ParallelDims.from_config(p).world
    check(world == 1, f"model.block_swap={n} is for one process (one GPU); over {world} ranks use FSDP2's "
           f"parallel.cpu_offload=true (FSDP2 manages its parameters' storage itself; block swap under DDP is not tested)", e)


def _low_bit_optim(cfg: Config, e: list[str]) -> None:
    """optim.name=adamw8bit (dit_train/optim/low_bit.py): one process (FSDP2 would quantize each
    rank's shard in its own blocks; under DDP / dp_replicate the gradient sum's order flips 8-bit
    codes: measured up to 1.0e-2 of the update from one process, docs/one-gpu.md), and torchao
    installed with its compiled step running on this device."""
    if str(cfg.optim.name) != "adamw8bit":
        return
    dims = ParallelDims.from_config(cfg.parallel)
    if dims.world > 1:
        e.append(f"optim.name=adamw8bit runs on one process ({dims.describe()}): under FSDP2 torchao quantizes each "
                 f"rank's shard in its own 256-value blocks, and under DDP or dp_replicate the gradient sum's order flips "
                 f"8-bit codes (measured up to 1e-2 of the update from one process); use optim.name=adamw for several ranks")
        return
    reason = low_bit.probe("cuda" if runs_on_cuda(cfg.parallel.device) else "cpu")
    check(not reason, reason, e)
