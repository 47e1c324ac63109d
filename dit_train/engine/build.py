"""The one recipe that turns a config into something that trains:

    config -> parallel context -> task -> model (registry) -> initialise -> parallelize
           -> optimizer / LR schedule -> Trainer

Training, the deferred-normalization session, layout verification, the planner's smoke runs,
the benchmarks and the tests all build through `build_run`, so a new part of a run (EMA,
adapters, ...) is added here once.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dit_train.checkpoint import training_parts
from dit_train.config import Config
from dit_train.engine.block_swap import BlockSwap
from dit_train.engine.ema import EMA
from dit_train.engine.trainer import Trainer
from dit_train.models import build_model, model_spec
from dit_train.models.init import init_adapters, init_weights, load_full_weights
from dit_train.models.quant import quantize_base
from dit_train.models.lora import add_frozen_adapter, apply_lora, load_lora, base_parameters, is_lora_name, lora_settings, plain_lora_name
from dit_train.optim import build_optimizer, build_scheduler
from dit_train.parallel.mesh import ParallelContext, init_parallel
from dit_train.parallel.parallelize import parallelize
from dit_train.perf.cost import run_cost
from dit_train.perf.memory import model_shape
from dit_train.kernels import resolve_backend
from dit_train.tasks import build_task, resolve_config


@dataclass
class Run:
    """Everything one rank trains with."""

    cfg: Config
    ctx: ParallelContext
    task: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    trainer: Trainer
    heldout: Any = None  # the held-out task (evaluation), when the source has one and train.eval_every > 0
    ema: EMA | None = None  # EMA of the trainable weights (train.ema_decay > 0)

    def checkpoint_parts(self) -> dict[str, Any]:
        """The stateful parts a checkpoint of this run holds (dit_train/checkpoint/parts.py)."""
        lora = self.cfg.model.lora.rank > 0
        parts = training_parts(self.model, self.optimizer, self.scheduler, self.trainer, trainable_only=lora)
        if self.ema is not None:
            parts["ema"] = self.ema
        return parts


def set_threads(threads_per_worker: int, local_world: int) -> None:
    """torch intra-op threads: the configured number, or the cores shared by the local workers."""
    if threads_per_worker > 0:
        torch.set_num_threads(threads_per_worker)
    elif local_world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def load_pretrained(model: nn.Module, model_cfg: Any, ctx: ParallelContext) -> None:
    """The model's pretrained weights, read once by rank 0 (`broadcast_full_weights`)."""
    spec = model_spec(model_cfg)
    broadcast_full_weights(model, ctx, lambda: spec.pretrained(model_cfg))


def broadcast_full_weights(model: nn.Module, ctx: ParallelContext, read: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Fill the model's base (non-adapter) parameters with full weights `read()` returns under
    the plain model's names, read once: by rank 0, which broadcasts each tensor while every rank
    keeps its shard (torch.distributed.checkpoint's set_model_state_dict with
    broadcast_from_rank0, over the default process group); plain, FSDP2 or DDP-wrapped models.
    Host memory: one full copy on rank 0 (none elsewhere with a meta-device build)."""
    if not ctx.distributed:
        load_full_weights(getattr(model, "module", model), read())  # DDP: the wrapped model's names
        return
    # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start); a distributed run only
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    full: dict[str, torch.Tensor] = {}
    if ctx.is_main:
        sd = read()
        want = base_parameters(getattr(model, "module", model))  # plain names; checks missing / unexpected keys
        missing, unexpected = sorted(want.keys() - sd.keys()), sorted(sd.keys() - want.keys())
        if missing or unexpected:
            raise ValueError(f"pretrained weights do not fit the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        # DCP addresses parameters by their fully qualified names (wrappers removed, peft's kept)
        fqns = {plain_lora_name(k): k for k in get_model_state_dict(model) if not is_lora_name(k)}
        full = {fqns[k]: v for k, v in sd.items()}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))


def refuse_unfilled_buffers(model: nn.Module) -> None:
    """Raise if `model` (built on the meta device) holds a non-persistent buffer: `to_empty` leaves
    its memory uninitialised and neither `init_weights` nor a pretrained state dict fills it (a
    state dict has no non-persistent buffers), so the forward would read garbage — silently, and
    only on the meta path (MiniMax-H3's RoPE table was such a buffer: LoRA on dp_shard=2 was off
    by 12 %). A family computes such tables in its forward instead (models/rope.py)."""
    unfilled = [f"{name}.{buf}" if name else buf for name, mod in model.named_modules()
                for buf in mod._non_persistent_buffers_set]
    if unfilled:
        raise RuntimeError(f"{type(model).__name__} has non-persistent buffers {unfilled[:4]}: a model built on the "
                           "meta device would read them uninitialised; compute them in the forward (a model-family "
                           "defect, not a setting)")


def build_parallel_model(cfg: Config, ctx: ParallelContext, adapters: tuple[str, ...] = ()) -> nn.Module:
    """Plain model (+ LoRA adapters) -> initialised -> parallelized. Initial weights depend only
    on train.seed (or the pretrained folder), never on the layout. adapters: names of more LoRA
    adapters with model.lora's settings, added frozen and inactive (`add_frozen_adapter`: DMD2's
    critic on the student's base).

    Built on the meta device (no memory until sharded) with parallel.meta_init, and whenever
    pretrained weights will fill it under FSDP2 across ranks (no rank needs a random copy)."""
    spec = model_spec(cfg.model)
    backend = resolve_backend(cfg.model.attn_backend, ctx.device)
    pretrained = spec.pretrained is not None and bool(getattr(cfg.model, "pretrained", ""))
    lora = lora_settings(cfg.model)
    # a quantized base is quantized from full weights before parallelize (FSDP2 leaves it unsharded):
    # no meta build then
    quantized = str(cfg.model.base_quant) != "none"
    meta = not quantized and (cfg.parallel.meta_init or (pretrained and ctx.distributed and cfg.parallel.dp_mode == "fsdp2"))
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = build_model(cfg.model, backend)
        if lora is not None:
            apply_lora(model, lora, spec.name)  # before parallelize: FSDP2 shards base and adapters together
            for name in adapters:
                add_frozen_adapter(model, lora, spec.name, name)
    if meta:
        refuse_unfilled_buffers(model)
        model = parallelize(model, spec, ctx, cfg.parallel, cfg.model, cfg.train, backend)
        model.to_empty(device="cpu" if cfg.parallel.cpu_offload else ctx.device)  # offloaded shards live on the host
    if pretrained:
        load_pretrained(model, cfg.model, ctx)
    else:
        init_weights(model, cfg.train.seed, cfg.model.init)
    init_adapters(model, cfg.train.seed)
    if lora is not None and cfg.model.lora.init_from:  # every rank reads the file and keeps its shards
        load_lora(model, cfg.model.lora.init_from, spec.name)
    if meta:
        return model
    # quantized where the weights are built (host memory for a GPU run: the full-precision base never
    # reaches the device), then the swapped blocks' frozen weights go to host memory before the rest
    # moves to the device
    quantize_base(spec.blocks(model), str(cfg.model.base_quant))
    n_swap = cfg.model.block_swap
    swap = BlockSwap(list(spec.blocks(model))[-n_swap:], ctx.device) if n_swap > 0 else None
    model.to(ctx.device)
    model = parallelize(model, spec, ctx, cfg.parallel, cfg.model, cfg.train, backend)
    if swap is not None:  # hooks on the blocks as called: after activation checkpointing wrapped them
        swap.install(list(spec.blocks(model))[-n_swap:])
        model.block_swap_state = swap  # its resident_peak, for tests and memory reports
    return model


def build_run(cfg: Config, ctx: ParallelContext | None = None, *, task: Any = None, heldout: bool = False,
              adapters: tuple[str, ...] = ()) -> Run:
    """Build a rank's run from `cfg` inside the current process group (created if needed).

    task: use this task instead of the configured data's (e.g. the session's caller data).
    heldout: also build the held-out task (None when the source has none).
    adapters: frozen extra LoRA adapters of the model (`build_parallel_model`); the optimizer and
    the EMA hold what trains when it is built.
    The Run's cfg is `cfg` with train.micro_batch_tokens=0 (auto) resolved (resolve_config).
    """
    ctx = ctx or init_parallel(cfg.parallel)
    set_threads(cfg.parallel.threads_per_worker, int(os.environ.get("LOCAL_WORLD_SIZE", ctx.dims.world)))
    task = task or build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
    cfg = resolve_config(cfg, task.lengths())  # auto budget: resolved before the launch, except for direct callers
    held = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, split="heldout",
                      cond=cfg.cond) if heldout else None
    model = build_parallel_model(cfg, ctx, adapters)
    # Muon's matrices: the family's own blocks (DDP wraps the model: the wrapped module's)
    optimizer = build_optimizer(model, cfg.optim, blocks=model_spec(cfg.model).blocks(getattr(model, "module", model)))
    scheduler = build_scheduler(optimizer, cfg.optim, max(1, cfg.train.steps))
    cost = None
    if cfg.train.balance == "cost":  # a function of the config: every rank models the same times
        cost = run_cost(model_shape(cfg.model), cfg.model, cfg.parallel, ctx.device.type, getattr(task, "causal", False))
    trainer = Trainer(model, task, optimizer, scheduler, ctx, cfg.train, cfg.optim, cfg.loss, cfg.parallel, cfg.model.moe,
                      cost)
    if cfg.train.ema_decay > 0:
        trainer.ema = EMA(model, cfg.train.ema_decay)
    return Run(cfg, ctx, task, model, optimizer, scheduler, trainer, held, trainer.ema)
