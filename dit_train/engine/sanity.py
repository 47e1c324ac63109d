"""Whether a run can learn, and whether what it learned is usable: checks on the weights and the
first gradients that turn a silent useless run into one line saying what to change.

- `zero_head_error`: LoRA adapters on a base whose output head is all zero (a randomly
  initialised adaLN-zero DiT or Wan, no pretrained weights) never receive a gradient: the head
  multiplies every upstream gradient by zero, and the head itself is frozen.
- `nonfinite_weights`: after a skipped step (and at the end), whether an update left NaN/inf in
  the weights (e.g. a huge learning rate): every later step would be skipped.
- `nonfinite_hint`: what to change, without advice that is already followed.
- `Divergence`: a loss that stays far above its first value (finite, so no step is skipped:
  `optim.lr=1e6` "completed" with a final loss of 1.15e12) ends the run failed.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dit_train.models.quant import dequantized
from dit_train.models.lora import is_lora_name, plain_lora_name
from dit_train.sharded import is_dtensor


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of `p`: its shard, or a quantized base weight's dequantized values
    (torchao's tensors implement the ops of a linear layer, not isfinite / count_nonzero)."""
    return p.to_local() if is_dtensor(p) else dequantized(p)


def _any_rank(flag: bool, device: torch.device, group: Any) -> bool:
    """True if `flag` is set on any rank of `group` (one tiny all-reduce MAX; None = this process alone)."""
    if group is None:
        return flag
    t = torch.tensor(int(flag), dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t)


@torch.no_grad()
def nonfinite_weights(model: nn.Module, device: torch.device, group: Any) -> bool:
    """Whether any parameter holds NaN or inf, on any rank (each rank checks its own shards).
    Collective over `group` (the world group): every rank must call it."""
    bad = any(bool((~torch.isfinite(_local(p))).any()) for p in model.parameters())
    return _any_rank(bad, device, group)


@torch.no_grad()
def zero_head_error(model: nn.Module, lora_rank: int, device: torch.device, group: Any) -> str:
    """A message when LoRA adapts a model whose output head (the module named by the model's
    `output_head`) is all zero and not adapted itself, else "". Collective over `group`."""
    head = getattr(model, "output_head", None)
    if lora_rank <= 0 or head is None:
        return ""
    params = {plain_lora_name(n): p for n, p in model.named_parameters()}
    if any(is_lora_name(n) and n.startswith(head + ".") for n in params):
        return ""  # adapters on the head itself get a gradient, and through them the rest does
    weights = [p for n, p in params.items() if n.startswith(head + ".") and not is_lora_name(n)]
    nonzero = any(bool(_local(p).count_nonzero()) for p in weights)
    if not weights or _any_rank(nonzero, device, group):
        return ""
    return (f"model.lora.rank={lora_rank} adapts a base whose output head ({head}) is all zero (model.init=adaln_zero "
            f"without pretrained weights): no gradient reaches the adapters, they would never train; set "
            f"model.init=normal, start from pretrained weights (model.pretrained=...: a diffusers folder, or a trained run for model=dit), or train every "
            f"weight (model.lora.rank=0)")


def zero_gradient_warning(grad_norm: float, skipped: bool, lora_rank: int) -> str:
    """A warning for a first step whose trainable parameters got an exactly zero gradient (else "")."""
    if skipped or grad_norm != 0.0:
        return ""
    what = "the LoRA adapters" if lora_rank > 0 else "every trainable parameter"
    return (f"step 0: {what} got an exactly zero gradient (grad_norm 0): the run is not learning; a zero-initialised "
            f"output layer, frozen weights or an all-zero loss weighting cause this")


def nonfinite_hint(optim: Any, train: Any) -> str:
    """What to change when steps turn non-finite: only advice not already followed."""
    hints = [f"lower optim.lr (now {optim.lr:g})"]
    if optim.max_grad_norm <= 0:
        hints.append("enable clipping (optim.max_grad_norm=1)")
    if str(getattr(train.precision, "value", train.precision)) == "fp16":
        hints.append("use train.precision=bf16 instead of fp16")
    return ", ".join(hints) + " or check the data"


# Steps in a row the loss must stay above train.divergence_factor x its first value. The rule is
# meant never to trip on a healthy run: the quickstart's (make run, 1200 steps, batch 8) per-step
# loss peaks at 3.1x its first step's during the LR warm-up; from any step after the 100th (the
# reference of a resume from an old checkpoint) later steps reach at most 5.5x it, 2.8x for 3
# steps in a row. Several steps in a row spare the spikes of a heavy-tailed loss
# (loss.weighting=sigma_sqrt: 1/t^2).
DIVERGENCE_STEPS = 5


class Divergence:
    """Whether the loss diverged: above `factor` x the run's first finite loss (the reference)
    for DIVERGENCE_STEPS steps in a row, or, at the last step of a run with fewer steps after the
    reference, for every one of them (`optim.lr=1e6 train.steps=2`). The loss is compared per
    token: a `sum` reduction's loss grows with the step's tokens, `sample_sum`'s with its samples'
    lengths. Non-finite losses are train.max_skipped_steps' business: they neither count nor
    break a streak. factor 0 = off. Each rank sees the same global loss and counts, so every rank
    decides alike (no communication). Its state (the reference, the steps compared, the streak)
    is a checkpoint part: a resumed run judges as the uninterrupted one (a checkpoint without it,
    from before: the resumed launch's first step becomes the reference)."""

    def __init__(self, factor: float, reduction: str):
        self.factor, self.reduction = factor, str(reduction)
        self.reference: tuple[int, float] | None = None  # (step, loss per token)
        self.compared = 0  # steps compared with the reference
        self.streak: list[tuple[int, float]] = []  # the current run of steps above it

    def per_token(self, loss: float, tokens: float, samples: int) -> float | None:
        if tokens <= 0:  # a step where nothing carried loss says nothing about it
            return None
        if self.reduction == "sum":
            return loss / tokens
        if self.reduction == "sample_sum":
            return loss * samples / tokens
        return loss

    def update(self, step: int, loss: float, tokens: float, samples: int, last: bool) -> str:
        """"" or the error of a diverged run, after step `step` (`last`: the run's final step)."""
        value = self.per_token(loss, tokens, samples) if self.factor > 0 else None
        if value is None or not math.isfinite(value):
            return ""
        if self.reference is None:
            if value > 0:
                self.reference = (step, value)
            return ""
        self.compared += 1
        self.streak = self.streak + [(step, value)] if value > self.factor * self.reference[1] else []
        need = min(DIVERGENCE_STEPS, self.compared) if last else DIVERGENCE_STEPS
        if not self.streak or len(self.streak) < need:
            return ""
        first, (at, now) = self.streak[0][0], self.streak[-1]
        since = f"at step {at}" if first == at else f"at step {at} (since step {first})"
        return (f"the loss diverged: {now:.4g} {since}, above train.divergence_factor={self.factor:g} x the loss of "
                f"step {self.reference[0]} ({self.reference[1]:.4g}) for {len(self.streak)} step(s) in a row")

    def state_dict(self) -> dict[str, Any]:
        return {"reference": list(self.reference) if self.reference else None, "compared": self.compared,
                "streak": [list(p) for p in self.streak]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """ValueError for a hand-edited or damaged state (load_checkpoint names trainer.json)."""
        reference, compared, streak = state["reference"], state["compared"], state["streak"]

        def point(p: Any) -> tuple[int, float]:
            if not (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] >= 0
                    and isinstance(p[1], (int, float)) and math.isfinite(p[1]) and p[1] > 0):
                raise ValueError(f"{p!r:.40} is not [step, loss per token > 0]")
            return p[0], float(p[1])

        if type(compared) is not int or compared < 0 or not isinstance(streak, list):
            raise ValueError(f"compared={compared!r:.20}, streak={streak!r:.40}: not a count and a list")
        self.reference = point(reference) if reference is not None else None
        self.compared, self.streak = compared, [point(p) for p in streak]

