"""One optimizer step: plan -> build packs -> CP split -> count sync -> weighted backward
over micro-batches (gradient sync on the last only) -> SUM -> clip -> step.

The pieces are public so that other drivers (the deferred-normalization session) reuse them:
`prepare` (packs -> CP-local micro-batches), `sync_counts` (the metadata sync),
`per_token_loss`, `gradient_sync` (whether the wrapper reduces in this backward),
`flush_unreduced_gradients` and `apply_gradients` (scale, clip, optimizer, schedule, zero).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dit_train.data_pipelines.packing import StepCost, data_fingerprint, place, plan_step
from dit_train.batch import STREAMS, PackedBatch
from dit_train.config import LossConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig
from dit_train.engine.offload import activation_offload
from dit_train.loss import StepCounts, sync_counts, sync_expert_counts, token_weights, weighted_loss
from dit_train.loss.moe import expert_load, local_expert_counts, router_token_losses
from dit_train.models.moe import moe_layers
from dit_train.optim import local_step
from dit_train.parallel.context_parallel import split_for_cp
from dit_train.parallel.mesh import ParallelContext
from dit_train.parallel.parallelize import grad_sync_groups, sync_unsharded_grads
from dit_train.precision import DynamicLossScale, autocast
from dit_train.sharded import is_dtensor, is_fsdp_module, local_part
from dit_train.kernels import VarlenLayout


@dataclass
class MicroBatch:
    """One micro-batch on this rank: its CP-local tokens (on the device) and the attention
    layout the model needs (VarlenLayout, or CPAttnLayout under context parallelism)."""

    batch: PackedBatch
    attn: Any


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    samples: int
    micro_batches: int
    skipped: bool
    dropped: int = 0  # samples of this step whose data could not be read (skipped and counted)
    extras: dict[str, float] = field(default_factory=dict)  # e.g. moe/aux_loss, moe/load_max


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of gradients that live on one mesh with one placement (or none), as a plain
    tensor (on the mesh's device type)."""
    if grads and is_dtensor(grads[0]) and not any(p.is_partial() for p in grads[0].placements):
        return _sharded_total_norm(grads)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
    if is_dtensor(norm):  # partial gradients: DTensor's own reduction
        if norm.device.type != norm.device_mesh.device_type:  # CPU-offloaded shards: reduce on the mesh's device
            norm = norm.to(norm.device_mesh.device_type)
        norm = norm.full_tensor()
    return norm


def _sharded_total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of DTensor gradients sharing one mesh and one (Shard / Replicate)
    placement, from each rank's local parts: the local parts' norm, squared, summed over each
    mesh dimension the gradients are sharded on (one scalar all-reduce SUM on that dimension's
    process group), then the root. Replicated dimensions hold the same values and are not
    summed. torch's get_total_norm on the DTensors gives the same value through DTensor's
    dispatch: ~0.1 ms a gradient per step, and at the first step of a layout a sharding
    propagation per gradient shape (~4 ms each: ~0.07 CPU-s of a tiny FSDP2 rank's first step)."""
    mesh, placements = grads[0].device_mesh, grads[0].placements
    with torch.no_grad():
        local = torch.nn.utils.get_total_norm([g.to_local() for g in grads], norm_type=2.0, foreach=False)
        square = local.to(mesh.device_type) ** 2  # CPU-offloaded shards: reduce on the mesh's device
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(square, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        return square.sqrt()


def grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (across FSDP shards: the same value as one process); clip
    in place when max_norm > 0. Gradients on different meshes or placements (FSDP shards,
    expert-parallel experts) are normed per mesh and placement, then combined."""
    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        key = (p.grad.device_mesh, tuple(p.grad.placements)) if is_dtensor(p.grad) else None
        by_mesh.setdefault(key, []).append(p.grad)
    norms = [_total_norm(grads) for grads in by_mesh.values()] or [torch.zeros(())]
    norm = norms[0] if len(norms) == 1 else torch.stack([n.to(norms[0].device) for n in norms]).norm()
    if max_norm > 0 and math.isfinite(float(norm)):
        clip_grads_with_norm_([p.grad for p in params], max_norm, norm)
    return norm


@torch.no_grad()
def clip_grads_with_norm_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """grad *= min(max_norm / (norm + 1e-6), 1), torch.nn.utils.clip_grads_with_norm_'s
    arithmetic, on each gradient's local part: on the DTensor itself each `mul_` went through
    DTensor's dispatch (its first call per mesh and shape propagates the sharding on fake
    tensors, ~10 ms; ~40 % of a tiny FSDP2 rank job's step was such calls)."""
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    on_device: dict[torch.device, torch.Tensor] = {}
    for g in grads:
        local = local_part(g)
        if local.device not in on_device:
            on_device[local.device] = coef.to(local.device)
        local.mul_(on_device[local.device])


@torch.no_grad()
def scale_gradients_(model: nn.Module, factor: float) -> None:
    """grad *= factor in place (a DTensor gradient keeps its sharding)."""
    if factor == 1.0:
        return
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


class Trainer:
    """Runs optimizer steps on a parallelized model.

    task: builds full packs (`build(ids, step) -> PackedBatch`), knows its CP layout and
    computes per-token losses (`per_token_loss(model, batch, attn) -> [L_local]`).
    cost: train.balance=cost's time model (perf/cost.run_cost); None balances tokens.
    """

    def __init__(self, model: nn.Module, task: Any, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, ctx: ParallelContext,
                 train: TrainConfig, optim: OptimConfig, loss: LossConfig, parallel: ParallelConfig,
                 moe: MoEConfig | None = None, cost: StepCost | None = None):
        self.model, self.task, self.optimizer, self.scheduler, self.ctx = model, task, optimizer, scheduler, ctx
        self.cost = cost
        self.train_cfg, self.optim_cfg, self.loss_cfg, self.parallel_cfg = train, optim, loss, parallel
        self.moe_cfg = moe or MoEConfig()
        self.moe_layers = moe_layers(model)  # their router outputs feed the balance and z-losses
        self.lengths = dict(enumerate(task.lengths()))
        self._manual_sync = grad_sync_groups(ctx, parallel)
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self.dropped = 0  # unreadable samples of the last `prepare`
        self.loss_scale = DynamicLossScale() if train.precision == "fp16" else None
        self.ema = None  # an engine.ema.EMA, updated after every optimizer step taken

    # -- data ----------------------------------------------------------------------------------

    def plan(self, step: int) -> list[list[int]]:
        """This rank's packs (sample ids per micro-batch) of `step`; starts background decoding
        of them and of the next step's when the task can prefetch."""
        t = self.train_cfg
        warmup = (t.batch_warmup_steps, t.batch_warmup_start)
        plan = plan_step(step, self.lengths, t.global_batch, self.ctx.dims.dp, t.grad_accum, t.micro_batch_tokens,
                         t.seed, *warmup, cost=self.cost)
        packs = plan.micro_batches[self.ctx.dp_rank]
        if hasattr(self.task, "prefetch"):
            ids = [i for p in packs for i in p]
            if step + 1 < t.steps:
                nxt = plan_step(step + 1, self.lengths, t.global_batch, self.ctx.dims.dp, t.grad_accum,
                                t.micro_batch_tokens, t.seed, *warmup, cost=self.cost)
                ids += [i for p in nxt.micro_batches[self.ctx.dp_rank] for i in p]
            self.task.prefetch(ids)  # changes no result, only how long `build` waits
        return packs

    def spread(self, sample_ids: list[int], lengths: dict[int, int]) -> list[list[int]]:
        """This rank's packs of a given set of samples (balanced over DP ranks like a step's,
        then first-fit-decreasing); every rank gets the same number of packs (FSDP's collectives
        must match), empty ones where it has less work."""
        per_rank = place(list(sample_ids), lengths, self.ctx.dims.dp, 1, self.train_cfg.micro_batch_tokens, self.cost)
        return per_rank[self.ctx.dp_rank]

    def prepare(self, packs: list[list[int]], step: int, task: Any = None) -> list[MicroBatch]:
        """Build each pack of sample ids, split it for CP, move it to the device."""
        task = task or self.task
        out = []
        cp = self.ctx.dims.cp
        self.dropped = 0
        for ids in packs:
            full = task.build(ids, step)
            self.dropped += len(ids) - full.num_samples
            if cp > 1:
                local, attn = split_for_cp(full, cp, self.ctx.cp_rank, task.cp_layout)
                attn = attn.to(self.ctx.device)
            else:
                local = full.pad_to_multiple(1)  # an empty micro-batch still runs (collectives match)
                attn = None
            local = local.to(self.ctx.device)
            if attn is None:
                attn = VarlenLayout.build(local.seg, local.mask_order, local.causal)
            out.append(MicroBatch(local, attn))
        return out

    def sync_counts(self, micro: list[MicroBatch]) -> StepCounts:
        """The metadata sync: global counts of these micro-batches (T_b within CP, B and N
        across DP; see dit_train/loss/counts.py)."""
        # a task whose packs carry several streams (audio + video) counts T_{b,s} and B_s per stream
        return sync_counts([m.batch for m in micro], self.ctx.cp_group, self.ctx.dp_group, world=self.ctx.dims.world,
                           device=self.ctx.device, streams=getattr(self.task, "streams", 1))

    def per_token_loss(self, mb: MicroBatch, task: Any = None) -> torch.Tensor:
        """[L_local] loss of each local token (padding included; weights zero it)."""
        return (task or self.task).per_token_loss(self.model, mb.batch, mb.attn)

    def router_losses(self, mb: MicroBatch, counts: StepCounts, micro: int):
        """After a forward of a model with MoE layers: (a [L], z [L], load [M, E]) — the per-token
        balance term and z-loss of the local tokens (weighted like the main loss by the caller)
        and this rank's routed slots per layer and expert (for the load metrics). None without
        MoE layers. Reads and clears each layer's `routing`. One integer all-reduce within the
        CP group (the expert counts of whole samples, see loss/counts.py)."""
        routings = [layer.routing for layer in self.moe_layers]
        for layer in self.moe_layers:
            layer.routing = None
        if not routings or any(r is None for r in routings):
            return None
        b = mb.batch
        first = self.moe_layers[0]
        local = local_expert_counts(routings, b.seg, b.weight_units(), b.num_samples, first.num_experts)
        whole = sync_expert_counts(local.clone(), self.ctx.cp_group)
        aux, z = router_token_losses(routings, whole, counts.sample_tokens[micro], b.seg, first.top_k)
        return aux, z, local.sum(dim=1)

    @torch.no_grad()
    def heldout_loss(self, task: Any) -> dict[str, float]:
        """Token-mean loss (and, for causal LMs, perplexity) over every sample of `task`, shared
        across ranks. Video: fixed noise and timesteps (those of step 0 for each held-out clip).

        Exact and layout-independent: sums of weighted losses and of token weights are
        all-reduced once (eval_tokens: Σ w, the tokens that carry loss).
        """
        lengths = dict(enumerate(task.lengths()))
        packs = self.spread(list(lengths), lengths)
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for pack in packs:  # one pack at a time: evaluation sets can be large
            (mb,) = self.prepare([pack], step=0, task=task)
            with self.autocast():
                per_token = self.per_token_loss(mb, task)
            w = mb.batch.loss_weight().double()  # context tokens (conditioning) weigh 0
            totals[0] += (per_token.double() * w).sum()
            totals[1] += w.sum()
        self.model.train(was_training)
        if self.ctx.world_group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.ctx.world_group)
        loss = float(totals[0] / totals[1].clamp(min=1))
        out = {"eval_loss": loss, "eval_tokens": round(float(totals[1]))}
        if task.causal:
            out["eval_ppl"] = math.exp(min(loss, 50.0))
        return out

    # -- gradient sync control -----------------------------------------------------------------

    def gradient_sync(self, enabled: bool):
        """Context for a backward: the DP wrapper reduces gradients only when `enabled`."""
        if is_fsdp_module(self.model):
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) and not enabled:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def any_rank(self, flag: torch.Tensor) -> bool:
        """True if `flag` is set on any rank (one tiny all-reduce MAX over all ranks)."""
        if self.ctx.world_group is not None:
            flag = flag.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.world_group)
        return bool(flag)

    @property
    def can_skip_sync(self) -> bool:
        """FSDP2 must run its reduce-scatter on the last backward (its accumulated unsharded
        gradients live inside FSDP); DDP and manual sums can simply not communicate."""
        return not is_fsdp_module(self.model)

    def flush_unreduced_gradients(self, step: int) -> None:
        """Reduce gradients that backward passes left unreduced (gradient_sync(False)).

        FSDP2 and DDP reduce inside backward hooks, so a forward/backward of one padding token
        (loss 0) with sync enabled adds nothing and triggers exactly one reduction."""
        if self.ctx.distributed and self.parallel_cfg.dp_mode in ("fsdp2", "ddp"):
            (mb,) = self.prepare([[]], step)
            with self.gradient_sync(True):
                (self.per_token_loss(mb).sum() * 0.0).backward()
        sync_unsharded_grads(self.model, self._manual_sync, self.ctx)

    # -- the update ----------------------------------------------------------------------------

    def apply_gradients(self, grad_scale: float = 1.0, max_grad_norm: float | None = None,
                        known_bad: bool = False) -> tuple[torch.Tensor, bool]:
        """grad *= grad_scale, clip to the global norm, optimizer step (skipped when known_bad or
        the norm is not finite: the same decision on every rank), LR schedule, zero grads.
        Returns (global gradient norm, skipped)."""
        scale_gradients_(self.model, grad_scale)
        clip = self.optim_cfg.max_grad_norm if max_grad_norm is None else max_grad_norm
        norm = grad_norm_(self.model, clip)
        skipped = known_bad or not bool(torch.isfinite(norm))
        if skipped:
            self.skipped_in_a_row += 1
            self.skipped_total += 1
        else:
            self.skipped_in_a_row = 0
            local_step.step(self.optimizer)  # on the local shards: DTensor's dispatch per op adds only cost
            if self.ema is not None:
                self.ema.update()
        if self.loss_scale is not None:
            self.loss_scale.update(overflow=skipped)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    # -- the step ------------------------------------------------------------------------------

    def step(self, step: int) -> StepResult:
        micro = self.prepare(self.plan(step), step)
        counts = self.sync_counts(micro)
        reduction = self.loss_cfg.reduction
        loss_sum = torch.zeros((), device=self.ctx.device)
        # MoE only: Σ w·a (balance), Σ w·z (z-loss), then this rank's routed slots per layer and expert
        moe_size = 2 + sum(layer.num_experts for layer in self.moe_layers) if self.moe_layers else 0
        moe_sums = torch.zeros(moe_size, dtype=torch.float64, device=self.ctx.device)
        # several streams (audio + video): Σ w·l per stream, logged as loss/<stream> (they sum to the loss)
        streams = getattr(self.task, "streams", 1)
        stream_sums = torch.zeros(streams if streams > 1 else 0, dtype=torch.float64, device=self.ctx.device)
        nonfinite = torch.zeros((), dtype=torch.bool, device=self.ctx.device)
        scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
        known_bad = False
        n = len(micro)
        for k, mb in enumerate(micro):
            last = k == n - 1
            if last:
                # a non-finite loss on any rank is known before the gradient sync: the sync is
                # skipped where the wrapper allows it, and the step is skipped everywhere
                known_bad = self.any_rank(nonfinite)
            with self.gradient_sync(last and not (known_bad and self.can_skip_sync)), self.autocast(), \
                    activation_offload(self.train_cfg.activation_offload, self.ctx.device):
                per_token = self.per_token_loss(mb)
                weights = token_weights(reduction, mb.batch.seg, mb.batch.loss_weight(), counts, k,
                                        stream=mb.batch.stream,
                                        lambdas=None if mb.batch.stream is None else self.loss_cfg.stream_weights.as_tuple())
                loss = weighted_loss(per_token, weights)
                total = loss
                router = self.router_losses(mb, counts, k)
                if router is not None:
                    # the router terms take the main loss's token weights: the coefficients mean
                    # the same for every layout (dit_train/loss/moe.py)
                    aux, z = weighted_loss(router[0], weights), weighted_loss(router[1], weights)
                    total = loss + self.moe_cfg.aux_loss_coef * aux + self.moe_cfg.z_loss_coef * z
                    moe_sums += torch.cat([torch.stack([aux.detach(), z.detach()]).double(),
                                           router[2].reshape(-1).double()])
                (total * scale if scale != 1.0 else total).backward()
            nonfinite |= ~torch.isfinite(loss.detach())
            if stream_sums.numel() and mb.batch.stream is not None:
                part = (per_token.detach().double() * weights.double())
                stream_sums.index_add_(0, mb.batch.stream.clamp(0, streams - 1), part)
            loss_sum += loss.detach()
        if not known_bad:
            sync_unsharded_grads(self.model, self._manual_sync, self.ctx)
        norm, skipped = self.apply_gradients(grad_scale=1.0 / scale, known_bad=known_bad)
        # the logged loss is the true global Σ w·l: one detached all-reduce per step (with the
        # count of unreadable samples, taken once per CP group)
        dropped = float(self.dropped if self.ctx.cp_rank == 0 else 0)
        stats = torch.cat([torch.stack([loss_sum.double(), torch.tensor(dropped, dtype=torch.float64,
                                                                        device=loss_sum.device)]), moe_sums, stream_sums])
        if self.ctx.world_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.ctx.world_group)
        return StepResult(loss=float(stats[0]), grad_norm=float(norm), tokens=counts.num_tokens,
                          samples=counts.num_samples, micro_batches=n, skipped=skipped, dropped=int(stats[1]),
                          extras={**self.moe_metrics(stats[2:2 + moe_size]), **stream_losses(stats[2 + moe_size:])})

    def moe_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """moe/aux_loss, moe/z_loss (the weighted global terms, before their coefficients) and
        moe/load_min, moe/load_max (smallest / largest share of routed slots an expert got, over
        layers) from the step's all-reduced sums; {} without MoE layers."""
        if not self.moe_layers:
            return {}
        low, high = expert_load(sums[2:].view(len(self.moe_layers), -1))
        return {"moe/aux_loss": float(sums[0]), "moe/z_loss": float(sums[1]), "moe/load_min": low, "moe/load_max": high}

    def autocast(self):
        fsdp_casts = is_fsdp_module(self.model) and self.ctx.device.type == "cuda"
        return autocast(self.train_cfg.precision, self.ctx.device, fsdp_casts)

    # -- state for checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # "data": what the step plan was computed from, checked (not restored) before a resume
        # (engine/run_folder.py): a dataset that changed would give other steps
        return {"skipped_in_a_row": self.skipped_in_a_row, "skipped_total": self.skipped_total,
                "loss_scale": self.loss_scale.state_dict() if self.loss_scale is not None else None,
                "data": data_fingerprint(self.task.dataset, list(self.lengths.values()))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
        if self.loss_scale is not None and state.get("loss_scale"):
            self.loss_scale.load_state_dict(state["loss_scale"])


def stream_losses(sums: torch.Tensor) -> dict[str, float]:
    """loss/video, loss/audio: each stream's share Σ w·l of the step's loss (λ_s times its
    hierarchical mean), from the step's all-reduced per-stream sums; {} with one stream."""
    return {f"loss/{name}": float(v) for name, v in zip(STREAMS, sums.tolist())} if sums.numel() else {}
