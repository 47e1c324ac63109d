"""Whether a run can learn, and whether what it learned is usable: checks on the weights and the
first gradients that turn a silent useless run into one line saying what to change.

- `zero_head_error`: LoRA adapters on a base whose output head is all zero (a randomly
  initialised adaLN-zero DiT or Wan, no pretrained weights) never receive a gradient: the head
  multiplies every upstream gradient by zero, and the head itself is frozen.
- `nonfinite_weights`: after a skipped step (and at the end), whether an update left NaN/inf in
  the weights (e.g. a huge learning rate): every later step would be skipped.
- `nonfinite_hint`: what to change, without advice that is already followed.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dit_train.models.lora import is_lora_name, plain_lora_name


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


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
            f"model.init=normal, start from pretrained weights (model.pretrained=... with model=wan_*), or train every "
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
