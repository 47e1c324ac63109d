"""`parallelize(model, spec, ctx, cfg, ...)`: the one place a plain model becomes a distributed one.

Order (as in torchtitan): context parallelism (swap every attention callable), activation
checkpointing, torch.compile per block, then data parallelism (FSDP2 per block + root, or DDP).

The gradient path is a SUM everywhere: the loss already carries the global weights (see
dit_train/loss), so any averaging would divide the single-device gradient by the world size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dit_train.config import ParallelConfig, TrainConfig
from dit_train.kernels.eager import disable_compile
from dit_train.models.moe import moe_layers
from dit_train.sharded import is_fsdp_module, local_part
from dit_train.models.quant import quantized_parameters
from dit_train.parallel.expert_parallel import apply_expert_parallel, expert_parameters, sync_expert_grads
from dit_train.models.registry import ModelSpec
from dit_train.parallel.checkpointing import apply_activation_checkpointing
from dit_train.parallel.context_parallel import ContextParallelAttention
from dit_train.parallel.mesh import ParallelContext, fsdp_mesh


def apply_context_parallel(model: nn.Module, spec: ModelSpec, ctx: ParallelContext, backend: str) -> None:
    """Swap the attention callable of every layer the model's spec names for the CP one."""
    cp_attn = ContextParallelAttention(
        ctx.ulysses_group, ctx.dims.cp_ulysses, ctx.ulysses_rank,
        ctx.ring_group, ctx.dims.cp_ring, ctx.ring_rank, backend,
    )
    for layer in spec.attention_layers(model):
        layer.attention_fn = cp_attn


def apply_compile(blocks: nn.ModuleList) -> None:
    disable_compile()  # the per-run attention loops stay eager (kernels/eager.py)
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, dynamic=True)


def _sum_allreduce_hook(process_group, bucket):
    """DDP comm hook: all-reduce SUM (DDP's default divides by the world size).

    No annotations: DDP inspects them and `from __future__ import annotations` turns them
    into strings it rejects."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def fsdp_mp_policies(param_dtype: torch.dtype | None) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(root, block) FSDP2 mixed-precision policies: parameters in `param_dtype` (bf16/fp16
    on CUDA), gradients reduced in fp32. The root does not cast its forward inputs: it
    would round the per-clip flow time t to bf16 (Wan's timestep 1000·t by up to ~2) before
    the fp32 sinusoidal embedding; the models cast what enters their first matmuls
    themselves. Blocks do cast theirs (activations, conditioning, RoPE tables)."""
    # deferred: torch.distributed.fsdp imports torch.distributed.tensor (~1.5 s at every start)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    root = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    block = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return root, block


def router_mp_policy() -> MixedPrecisionPolicy:
    """FSDP2 policy of a MoE router's own unit: fp32 parameters and gradients whatever the
    model's compute dtype (the router casts its input to fp32 itself)."""
    # deferred: torch.distributed.fsdp imports torch.distributed.tensor (~1.5 s at every start)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList, ctx: ParallelContext, cfg: ParallelConfig,
               param_dtype: torch.dtype | None) -> None:
    """FSDP2 per block, then the root (the rest of the parameters), SUM gradient reduction;
    with parallel.cpu_offload the shards (parameters, gradients, hence optimizer state) live in
    host memory (pinned on CUDA; pinning needs an accelerator, so plain memory on a CPU run)."""
    # deferred: FSDP2 imports torch.distributed.tensor (~1.5 s), which one-process runs never need
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    mesh = fsdp_mesh(ctx, cfg.cp_fsdp_mode)
    root_mp, block_mp = fsdp_mp_policies(param_dtype)
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    # MoE routers: their own FSDP unit that keeps fp32 parameters under a bf16 policy (routing is a
    # discrete choice on small logit differences; models/moe.py computes it in fp32 as well)
    # experts split by expert parallelism are not FSDP's: their gradients are summed over the
    # replica group instead (parallel/expert_parallel.py)
    ignored = set(expert_parameters(model)) if ctx.ep > 1 else set()
    # a quantized frozen base (model.base_quant): torchao's tensor subclasses are not sharded; each
    # rank holds the whole quantized base, frozen, identical everywhere (dit_train/models/quant.py)
    ignored |= set(quantized_parameters(model))
    ignored = ignored or None
    for layer in moe_layers(model):
        fully_shard(layer.router, mesh=mesh, mp_policy=router_mp_policy(), reshard_after_forward=cfg.reshard_after_forward,
                    offload_policy=offload)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=block_mp, reshard_after_forward=cfg.reshard_after_forward,
                    offload_policy=offload, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=root_mp, reshard_after_forward=False, offload_policy=offload,
                ignored_params=ignored)
    n = cfg.fsdp_prefetch
    if n > 0:
        blocks = list(blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + n])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - n):i][::-1])
    for m in model.modules():
        if is_fsdp_module(m):
            # Sum, never average. force_sum keeps the collective a plain SUM (gloo has no
            # PREMUL_SUM; NCCL's had silent bf16 bugs); the divide factor 1.0 then means no scaling.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def parallelize(model: nn.Module, spec: ModelSpec, ctx: ParallelContext, cfg: ParallelConfig, model_cfg,
                train_cfg: TrainConfig, attn_backend: str) -> nn.Module:
    """Apply CP, activation checkpointing, compile and data parallelism to a plain model, at
    the places its spec names (attention layers, blocks).

    Returns the module to train (the same object for FSDP2, a DDP wrapper for DDP).
    The CP gradient all-reduce needed when CP is not folded into the DP group is done by
    `sync_unsharded_grads` after the last micro-batch's backward.
    """
    blocks = spec.blocks(model)
    if ctx.dims.cp > 1:
        apply_context_parallel(model, spec, ctx, attn_backend)
    if ctx.ep > 1:
        apply_expert_parallel(model, ctx)
    apply_activation_checkpointing(blocks, model_cfg.activation_checkpointing, model_cfg.ac_every)
    if train_cfg.compile:
        apply_compile(blocks)
    if not ctx.distributed or cfg.dp_mode == "none":
        return model.to(ctx.device)
    if cfg.dp_mode == "fsdp2":
        param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train_cfg.precision) if ctx.device.type == "cuda" else None
        apply_fsdp(model, blocks, ctx, cfg, param_dtype)
        return model
    if cfg.dp_mode == "ddp":
        group = ctx.world_group if cfg.cp_fsdp_mode == "all" else ctx.views["dp"].get_group()
        # expert-parallel weights: summed over their replica group, not by DDP; a quantized base:
        # frozen and the same on every rank (no broadcast of torchao's tensors)
        names = {id(p) for p in (expert_parameters(model) if ctx.ep > 1 else [])} | {id(p) for p in quantized_parameters(model)}
        if names:
            DDP._set_params_and_buffers_to_ignore_for_model(
                model, [n for n, p in model.named_parameters() if id(p) in names])
        ddp = DDP(model.to(ctx.device), process_group=group,
                  device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        ddp.register_comm_hook(group, _sum_allreduce_hook)
        return ddp
    raise ValueError(f"parallel.dp_mode={cfg.dp_mode!r} must be fsdp2, ddp or none")


def grad_sync_groups(ctx: ParallelContext, cfg: ParallelConfig) -> list[dist.ProcessGroup]:
    """Groups whose gradient SUM is not done by the DP wrapper and must be done by hand.

    dp_mode=none: the whole world. FSDP2/DDP with cp_fsdp_mode=none: the CP group.
    """
    if not ctx.distributed:
        return []
    if cfg.dp_mode == "none":
        return [ctx.world_group]
    if cfg.cp_fsdp_mode == "none" and ctx.cp_group is not None:
        return [ctx.cp_group]
    return []


@torch.no_grad()
def sync_unsharded_grads(model: nn.Module, groups: list[dist.ProcessGroup], ctx: ParallelContext | None = None) -> None:
    """All-reduce SUM every gradient over `groups` (local shards for FSDP DTensors: the CP
    ranks of one dp_shard position hold the same shard layout); expert-parallel weights are
    summed over their replica group instead (`ctx`, when parallel.ep > 1)."""
    skip: set[int] = set()
    if ctx is not None and ctx.ep > 1:
        sync_expert_grads(model, ctx)
        skip = {id(p) for p in expert_parameters(model)}
    if not groups:
        return

    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in skip]
    locals_ = [local_part(g) for g in grads]
    if not locals_:
        return
    flat = torch.cat([t.reshape(-1) for t in locals_])
    for group in groups:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in locals_:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
