"""Deferred normalization: `forward_backward` any number of times, then `optim_step`.

For RL and service-style training, where the caller decides how much data makes a step:

    session = TrainingSession(cfg)                       # model, optimizer, parallel layout
    session.forward_backward(ids_a, token_sum_loss())    # back-propagates raw sums
    session.forward_backward(ids_b, token_sum_loss())    # ... as many calls as you like
    session.optim_step(normalization="num_loss_tokens")  # grads *= 1/N, clip, step, zero

Each call back-propagates the raw Σ l (or per-sample sums) of its samples and adds the call's
*global* counts (valid tokens, sequences with >= 1 valid token; one small metadata sync per
call) to an accumulator. `optim_step` scales every gradient in place by 1/count — `grad.mul_`,
which keeps FSDP2's DTensor gradients sharded — then clips, steps and resets. Gradient
communication happens once per optim_step: calls accumulate unreduced gradients and the step
flushes them with one reduction (FSDP2 and DDP alike).

| loss function            | raw_sum | optim_step normalization | equals trainer reduction |
|--------------------------|---------|--------------------------|--------------------------|
| token_sum_loss()         | True    | "num_loss_tokens"        | token_mean               |
| token_sum_loss()         | True    | "num_sequences"          | sample_sum               |
| sequence_mean_sum_loss() | True    | "num_sequences"          | sample_mean              |
| token_sum_loss()         | True    | "none"                   | sum                      |
| token_mean_loss()        | False   | "none"                   | token_mean of each call  |

A pre-normalized loss (raw_sum=False) with a normalizing optim_step would divide twice (the
bug that collapses grad_norm by the batch size): it is refused with an error.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from data_pipelines.packing import balanced_split, pack_ffd
from dit_train.config import Config
from dit_train.data import build_task
from dit_train.loss import StepMeta
from dit_train.optim import build_optimizer, build_scheduler
from dit_train.parallel.mesh import init_parallel
from dit_train.parallel.parallelize import grad_sync_groups, sync_unsharded_grads
from dit_train.train import build_parallel_model
from dit_train.trainer import Trainer, grad_norm_

NORMALIZATIONS = ("num_loss_tokens", "num_sequences", "none")


class DoubleNormalizationError(ValueError):
    """A pre-normalized loss (raw_sum=False) met a normalizing optim_step."""


@dataclass(frozen=True)
class LossFn:
    """How a call turns per-token losses into what it back-propagates.

    weight: "token" (w = 1: raw token sum), "sequence" (w = 1/T_b: per-sequence means, summed)
    or "call_token_mean" (w = 1/N of this call: already normalized).
    raw_sum: True when the result still needs dividing by a count at optim_step.
    """

    weight: str
    raw_sum: bool

    def weights(self, seg: torch.Tensor, valid: torch.Tensor, meta: StepMeta, micro: int) -> torch.Tensor:
        v = valid.to(torch.float32)
        if self.weight == "token":
            return v
        if self.weight == "sequence":
            T = meta.sample_tokens[micro].to(device=seg.device, dtype=torch.float32)
            T_tok = T[seg.clamp(min=0)] if T.numel() else torch.zeros_like(v)
            return torch.where(valid & (T_tok > 0), 1.0 / T_tok.clamp(min=1.0), 0.0)
        if self.weight == "call_token_mean":
            return v / meta.num_tokens if meta.num_tokens > 0 else v * 0
        raise ValueError(f"unknown loss weighting {self.weight!r}")


def token_sum_loss() -> LossFn:
    """Σ over valid tokens of the per-token loss (raw_sum=True)."""
    return LossFn("token", raw_sum=True)


def sequence_mean_sum_loss() -> LossFn:
    """Σ over sequences of each sequence's token mean (raw_sum=True; use num_sequences)."""
    return LossFn("sequence", raw_sum=True)


def token_mean_loss() -> LossFn:
    """Token mean over this call's global valid tokens (raw_sum=False; use normalization='none')."""
    return LossFn("call_token_mean", raw_sum=False)


class TrainingSession:
    """A model, its optimizer and a parallel layout, driven call by call.

    Every rank calls the same methods with the same arguments (the sample ids of the whole
    call); the session spreads the samples over data-parallel ranks and packs them by
    train.micro_batch_tokens, exactly like the trainer.
    """

    def __init__(self, cfg: Config, task: Any | None = None):
        self.cfg = cfg
        self.ctx = init_parallel(cfg.parallel)
        self.task = task or build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
        self.model = build_parallel_model(cfg, self.ctx)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, max(1, cfg.train.steps))
        # the trainer supplies batch building, CP splitting, metadata sync and norms
        self._trainer = Trainer(self.model, self.task, self.optimizer, self.scheduler, self.ctx,
                                cfg.train, cfg.optim, cfg.loss, cfg.parallel)
        self._lengths = dict(enumerate(self.task.lengths()))
        self._manual_groups = grad_sync_groups(self.ctx, cfg.parallel)
        self.step_count = 0
        self._reset()

    def _reset(self) -> None:
        self.num_loss_tokens = 0
        self.num_sequences = 0
        self._raw_sums: set[bool] = set()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        self._pending_sync = False

    # -- gradient sync control ---------------------------------------------------------------

    def _no_sync(self):
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _flush_gradients(self) -> None:
        """Reduce the gradients accumulated (unreduced) by all calls since the last step.

        FSDP2 and DDP reduce inside backward hooks, so a forward/backward of one padding token
        (loss 0) with sync enabled adds nothing and triggers exactly one reduction.
        """
        if self.ctx.distributed and self.cfg.parallel.dp_mode in ("fsdp2", "ddp"):
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(True)
            (batch,), (meta,) = self._trainer._prepare(self.task, [[]], self.step_count)
            (self._trainer.task_loss(self.task, batch, meta).sum() * 0.0).backward()
        sync_unsharded_grads(self.model, self._manual_groups)

    # -- the API -------------------------------------------------------------------------------

    def forward_backward(self, sample_ids: list[int], loss_fn: LossFn) -> dict[str, float]:
        """Forward + backward of `sample_ids` (the whole call, same list on every rank).

        Back-propagates Σ w·l with the loss function's weights and adds the call's global
        counts to the accumulator. Returns the call's counts and its (weighted) loss.
        """
        per_rank = [pack_ffd(ids, self._lengths, self.cfg.train.micro_batch_tokens)
                    for ids in balanced_split(list(sample_ids), self._lengths, self.ctx.dims.dp)]
        m = max(1, max(len(r) for r in per_rank))
        packs = per_rank[self.ctx.dp_rank] + [[] for _ in range(m - len(per_rank[self.ctx.dp_rank]))]
        batches, metas = self._trainer._prepare(self.task, packs, self.step_count)
        meta = self._trainer.sync(batches)
        call_loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        with self._no_sync():
            for k, (batch, attn_meta) in enumerate(zip(batches, metas)):
                per_token = self._trainer.task_loss(self.task, batch, attn_meta)
                loss = (per_token.float() * loss_fn.weights(batch.seg, batch.valid, meta, k)).sum()
                loss.backward()
                call_loss += loss.detach().double()
        self._pending_sync = True
        self._raw_sums.add(loss_fn.raw_sum)
        self.num_loss_tokens += meta.num_tokens
        self.num_sequences += meta.num_samples
        self._loss_sum += call_loss
        return {"num_loss_tokens": meta.num_tokens, "num_sequences": meta.num_samples}

    def optim_step(self, normalization: str = "num_loss_tokens", max_grad_norm: float | None = None) -> dict[str, float]:
        """Scale gradients by 1/accumulated count, clip, step, zero, reset the accumulator."""
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={normalization!r} must be one of {NORMALIZATIONS}")
        if normalization != "none" and False in self._raw_sums:
            raise DoubleNormalizationError(
                f"optim_step(normalization={normalization!r}) would divide gradients by a count, but a "
                f"forward_backward call used a pre-normalized loss (raw_sum=False): the gradient would be "
                f"normalized twice. Use raw-sum losses (token_sum_loss / sequence_mean_sum_loss) with "
                f"{normalization!r}, or optim_step(normalization='none') with pre-normalized losses.")
        if self._pending_sync:
            self._flush_gradients()
        count = {"num_loss_tokens": self.num_loss_tokens, "num_sequences": self.num_sequences, "none": 1}[normalization]
        scale = 1.0 / count if count > 0 else 0.0
        if scale != 1.0:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)  # in place: a DTensor gradient keeps its sharding
        clip = self.cfg.optim.max_grad_norm if max_grad_norm is None else max_grad_norm
        norm = grad_norm_(self.model, clip)
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss_sum.clone()
        if self.ctx.world_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.ctx.world_group)
        out = {"loss": float(loss) * scale, "grad_norm": float(norm), "num_loss_tokens": self.num_loss_tokens,
               "num_sequences": self.num_sequences, "skipped": skipped}
        self.step_count += 1
        self._reset()
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full unsharded weights (a collective under FSDP: call on every rank)."""
        from dit_train.checkpoint import full_state_dict

        return full_state_dict(self.model)
