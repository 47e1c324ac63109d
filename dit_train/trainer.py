"""One optimizer step: plan -> build packs -> CP split -> metadata sync -> weighted backward
over micro-batches (gradient sync on the last only) -> SUM -> clip -> step."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from data_pipelines.packing import balanced_split, pack_ffd, plan_step
from dit_train.batch import PackedBatch
from dit_train.config import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from dit_train.loss import StepMeta, sync_metadata, token_weights, weighted_loss
from dit_train.parallel.context_parallel import split_for_cp
from dit_train.precision import DynamicLossScale, autocast
from dit_train.parallel.mesh import ParallelContext
from dit_train.parallel.parallelize import grad_sync_groups, sync_unsharded_grads
from kernels import VarlenMeta


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    samples: int
    micro_batches: int
    skipped: bool
    dropped: int = 0  # samples of this step whose data could not be read (skipped and counted)


def grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (across FSDP shards: DTensor reductions give the same
    value as one process); clip in place when max_norm > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0 and math.isfinite(float(norm)):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)
    return norm


class Trainer:
    """Runs optimizer steps on a parallelized model.

    task: builds full packs (`build(ids, step) -> PackedBatch`), knows its CP layout and
    computes per-token losses (`per_token_loss(model, batch, attn_meta) -> [L_local]`).
    """

    def __init__(self, model: nn.Module, task: Any, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, ctx: ParallelContext,
                 train: TrainConfig, optim: OptimConfig, loss: LossConfig, parallel: ParallelConfig):
        self.model, self.task, self.optimizer, self.scheduler, self.ctx = model, task, optimizer, scheduler, ctx
        self.train_cfg, self.optim_cfg, self.loss_cfg, self.parallel_cfg = train, optim, loss, parallel
        self.lengths = dict(enumerate(task.lengths()))
        self._manual_sync = grad_sync_groups(ctx, parallel)
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self._dropped = 0
        self.loss_scale = DynamicLossScale() if train.precision == "fp16" else None

    # -- data ----------------------------------------------------------------------------------

    def micro_batches(self, step: int) -> tuple[list[PackedBatch], list[Any]]:
        """This rank's micro-batches of `step` (CP-local tokens, on device) and attention metas."""
        t = self.train_cfg
        plan = plan_step(step, self.lengths, t.global_batch, self.ctx.dims.dp, t.grad_accum, t.micro_batch_tokens, t.seed)
        if hasattr(self.task, "prefetch"):
            self._prefetch(step, plan.micro_batches[self.ctx.dp_rank])
        return self._prepare(self.task, plan.micro_batches[self.ctx.dp_rank], step)

    def _prefetch(self, step: int, packs: list[list[int]]) -> None:
        """Tell the task which samples this rank reads now and at step+1, so that background
        workers (data.num_workers) decode them while the model runs. Changes no result."""
        t = self.train_cfg
        ids = [i for p in packs for i in p]
        if step + 1 < t.steps:
            nxt = plan_step(step + 1, self.lengths, t.global_batch, self.ctx.dims.dp, t.grad_accum, t.micro_batch_tokens, t.seed)
            ids += [i for p in nxt.micro_batches[self.ctx.dp_rank] for i in p]
        self.task.prefetch(ids)

    def _prepare(self, task: Any, packs: list[list[int]], step: int) -> tuple[list[PackedBatch], list[Any]]:
        """Build each pack of sample ids, split it for CP, move it to the device."""
        batches, metas = [], []
        cp = self.ctx.dims.cp
        self._dropped = 0
        for ids in packs:
            full = task.build(ids, step)
            self._dropped += len(ids) - full.num_samples
            if cp > 1:
                local, meta = split_for_cp(full, cp, self.ctx.cp_rank, task.cp_layout)
                meta = meta.to(self.ctx.device)
            else:
                local = full.pad_to_multiple(1)  # an empty micro-batch still runs (collectives match)
                meta = None
            local = local.to(self.ctx.device)
            if meta is None:
                meta = VarlenMeta.build(local.seg, local.order, local.causal)
            batches.append(local)
            metas.append(meta)
        return batches, metas

    @torch.no_grad()
    def evaluate(self, task: Any) -> dict[str, float]:
        """Token-mean loss (and perplexity) over every sample of `task`, shared across ranks.

        Exact and layout-independent: sums of losses and of valid tokens are all-reduced once.
        """
        lengths = dict(enumerate(task.lengths()))
        per_rank = [pack_ffd(ids, lengths, self.train_cfg.micro_batch_tokens)
                    for ids in balanced_split(list(lengths), lengths, self.ctx.dims.dp)]
        m = max(len(r) for r in per_rank)  # same number of forwards on every rank (FSDP)
        packs = per_rank[self.ctx.dp_rank] + [[] for _ in range(m - len(per_rank[self.ctx.dp_rank]))]
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for k in range(m):  # one pack at a time: evaluation sets can be large
            (batch,), (meta,) = self._prepare(task, [packs[k]], step=0)
            with self._autocast():
                per_token = self.task_loss(task, batch, meta)
            totals[0] += (per_token.double() * batch.valid).sum()
            totals[1] += batch.valid.sum()
        self.model.train(was_training)
        if self.ctx.world_group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.ctx.world_group)
        loss = float(totals[0] / totals[1].clamp(min=1))
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(totals[1])}

    def task_loss(self, task: Any, batch: PackedBatch, meta: Any) -> torch.Tensor:
        return task.per_token_loss(self.model, batch, meta)

    def sync(self, batches: list[PackedBatch]) -> StepMeta:
        return sync_metadata(batches, self.ctx.cp_group, self.ctx.dp_group, world=self.ctx.dims.world, device=self.ctx.device)

    # -- gradient sync control -----------------------------------------------------------------

    def _sync_context(self, sync: bool):
        """Gradients are reduced only when `sync` (the last micro-batch of a step)."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) and not sync:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _any_rank(self, flag: torch.Tensor) -> bool:
        """True if `flag` is set on any rank (one tiny all-reduce MAX over all ranks)."""
        if self.ctx.world_group is not None:
            flag = flag.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.world_group)
        return bool(flag)

    @property
    def _can_skip_sync(self) -> bool:
        """FSDP2 must run its reduce-scatter on the last backward (its accumulated unsharded
        gradients live inside FSDP); DDP and manual sums can simply not communicate."""
        return not isinstance(self.model, FSDPModule)

    # -- the step ------------------------------------------------------------------------------

    def step(self, step: int) -> StepResult:
        batches, attn_metas = self.micro_batches(step)
        meta = self.sync(batches)
        reduction = self.loss_cfg.reduction
        loss_sum = torch.zeros((), device=self.ctx.device)
        nonfinite = torch.zeros((), dtype=torch.bool, device=self.ctx.device)
        scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
        known_bad = False
        n = len(batches)
        for k, (batch, attn_meta) in enumerate(zip(batches, attn_metas)):
            last = k == n - 1
            if last:
                # a non-finite loss on any rank is known before the gradient sync: the sync is
                # skipped where the wrapper allows it, and the step is skipped everywhere
                known_bad = self._any_rank(nonfinite)
            with self._sync_context(last and not (known_bad and self._can_skip_sync)), self._autocast():
                per_token = self.task.per_token_loss(self.model, batch, attn_meta)
                weights = token_weights(reduction, batch.seg, batch.valid, meta, k)
                loss = weighted_loss(per_token, weights)
                (loss * scale if scale != 1.0 else loss).backward()
            nonfinite |= ~torch.isfinite(loss.detach())
            loss_sum += loss.detach()
        if not known_bad:
            sync_unsharded_grads(self.model, self._manual_sync)
        if scale != 1.0:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0 / scale)
        norm = grad_norm_(self.model, self.optim_cfg.max_grad_norm)
        # known_bad and the norm are global quantities (same on every rank): consistent skips
        skipped = known_bad or not bool(torch.isfinite(norm))
        if skipped:
            self.skipped_in_a_row += 1
            self.skipped_total += 1
        else:
            self.skipped_in_a_row = 0
            self.optimizer.step()
        if self.loss_scale is not None:
            self.loss_scale.update(overflow=skipped)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the logged loss is the true global Σ w·l: one detached all-reduce per step (with the
        # count of unreadable samples, taken once per CP group)
        stats = torch.stack([loss_sum.double(), torch.tensor(float(self._dropped if self.ctx.cp_rank == 0 else 0),
                                                               dtype=torch.float64, device=loss_sum.device)])
        if self.ctx.world_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.ctx.world_group)
        return StepResult(loss=float(stats[0]), grad_norm=float(norm), tokens=meta.num_tokens,
                          samples=meta.num_samples, micro_batches=n, skipped=skipped, dropped=int(stats[1]))

    def _autocast(self):
        fsdp_casts = isinstance(self.model, FSDPModule) and self.ctx.device.type == "cuda"
        return autocast(self.train_cfg.precision, self.ctx.device, fsdp_casts)

    # -- state for checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_in_a_row": self.skipped_in_a_row, "skipped_total": self.skipped_total,
                "loss_scale": self.loss_scale.state_dict() if self.loss_scale is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
        if self.loss_scale is not None and state.get("loss_scale"):
            self.loss_scale.load_state_dict(state["loss_scale"])
