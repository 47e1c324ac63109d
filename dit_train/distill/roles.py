"""Which network a distillation forward runs: the student, the critic or the teacher.

Full models (model.lora.rank = 0): three modules, each built and sharded by the plain recipe.
LoRA (model.lora.rank > 0, the memory-cheap way): ONE module, sharded once — the teacher's
weights as the frozen base, the student's adapter (peft's `default`: what the run trains with
its optimizer and EMA, exports and samples, as any LoRA run) and the critic's adapter
(`critic`, its own optimizer); the teacher is the base with every adapter off. Memory: one
base + two adapters instead of three models.

`Roles.use(who)` selects the network for the forward and the backward inside it (peft's
per-layer active adapter; `models/lora.adapter_in_use`). Outside it the student's adapter is
active, so the worker's validation videos and held-out loss see the student.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from dit_train.models.lora import ADAPTER, adapter_in_use

CRITIC = "critic"  # the critic's peft adapter name in a LoRA distillation
_ADAPTERS = {"student": ADAPTER, "critic": CRITIC, "teacher": None}


class Roles:
    """The student's, the critic's and the teacher's module (the same one under LoRA)."""

    def __init__(self, student: nn.Module, critic: nn.Module, teacher: nn.Module):
        self.models = {"student": student, "critic": critic, "teacher": teacher}
        self.shared = student is critic
        if self.shared and teacher is not student:
            raise ValueError("a LoRA distillation's teacher is its student's base (the same module)")

    @contextlib.contextmanager
    def use(self, who: str) -> Iterator[nn.Module]:
        """The module that computes `who` ("student", "critic" or "teacher") inside the block."""
        model = self.models[who]
        if not self.shared:
            yield model
            return
        with adapter_in_use(getattr(model, "module", model), _ADAPTERS[who]):
            yield model
