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

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dit_train.config import Config
from dit_train.engine.build import build_run
from dit_train.loss import StepCounts, inverse_sample_tokens, token_weights

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

    def weights(self, seg: torch.Tensor, valid: torch.Tensor, counts: StepCounts, micro: int) -> torch.Tensor:
        """[L] weights from the loss reductions' own functions (dit_train/loss/reductions.py)."""
        if self.weight == "token":
            return token_weights("sum", seg, valid, counts, micro)
        if self.weight == "sequence":
            return inverse_sample_tokens(seg, valid, counts, micro)
        if self.weight == "call_token_mean":
            return token_weights("token_mean", seg, valid, counts, micro)
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
    train.micro_batch_tokens, exactly like the trainer (whose public step pieces it uses).
    """

    def __init__(self, cfg: Config, task: Any | None = None):
        self.cfg = cfg
        run = build_run(cfg, task=task)
        self.run, self.ctx, self.task, self.model = run, run.ctx, run.task, run.model
        self.optimizer, self.scheduler, self._trainer = run.optimizer, run.scheduler, run.trainer
        self._lengths = dict(enumerate(self.task.lengths()))
        self.step_count = 0
        self._reset()

    def _reset(self) -> None:
        self.num_loss_tokens = 0
        self.num_sequences = 0
        self._raw_sums: set[bool] = set()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        self._pending_sync = False

    # -- the API -------------------------------------------------------------------------------

    def forward_backward(self, sample_ids: list[int], loss_fn: LossFn) -> dict[str, float]:
        """Forward + backward of `sample_ids` (the whole call, same list on every rank).

        Back-propagates Σ w·l with the loss function's weights and adds the call's global
        counts to the accumulator. Returns the call's counts and its (weighted) loss.
        """
        tr = self._trainer
        micro = tr.prepare(tr.spread(sample_ids, self._lengths), self.step_count)
        counts = tr.sync_counts(micro)
        call_loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for k, mb in enumerate(micro):
            with tr.gradient_sync(False):  # reduced once, at optim_step
                per_token = tr.per_token_loss(mb)
                loss = (per_token.float() * loss_fn.weights(mb.batch.seg, mb.batch.valid, counts, k)).sum()
                loss.backward()
            call_loss += loss.detach().double()
        self._pending_sync = True
        self._raw_sums.add(loss_fn.raw_sum)
        self.num_loss_tokens += counts.num_tokens
        self.num_sequences += counts.num_samples
        self._loss_sum += call_loss
        return {"num_loss_tokens": counts.num_tokens, "num_sequences": counts.num_samples}

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
            self._trainer.flush_unreduced_gradients(self.step_count)
        count = {"num_loss_tokens": self.num_loss_tokens, "num_sequences": self.num_sequences, "none": 1}[normalization]
        scale = 1.0 / count if count > 0 else 0.0
        norm, skipped = self._trainer.apply_gradients(grad_scale=scale, max_grad_norm=max_grad_norm)
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
