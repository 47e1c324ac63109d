"""The stateful parts a checkpoint is made of.

A checkpoint is a dict of named parts; each part has `state_dict()` / `load_state_dict()` and
says how it is stored:

- sharded parts (model weights, optimizer state, EMA weights, ...) hold tensors and go
  through torch.distributed.checkpoint: stored by parameter name with global shapes, so any
  layout loads any other's (DCP reshards);
- small parts (LR schedule, trainer counters, loss scale, ...) are JSON, written by rank 0 into
  trainer.json, identical on every rank.

Adding a part to a run is one entry in the dict the worker passes to `save_checkpoint`.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class Part(Protocol):
    sharded: bool  # True: tensors through DCP; False: JSON written by rank 0
    optional: bool  # True: a checkpoint without this part still loads (then `missing_from_checkpoint()`
    # is called if the part has it, after every other part was loaded; else it keeps its state)
    # A sharded part may also have `stored_only(template, stored keys) -> template`: its loading
    # template cut to what the checkpoint holds (OptimizerState).

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelState:
    """The (possibly sharded) model's weights, keyed by the plain model's parameter names.
    trainable_only: only the parameters that train (LoRA adapters: the checkpoint grows with
    the adapters, not the model; the frozen base comes back from its own initialisation)."""

    sharded, optional = True, False

    def __init__(self, model: nn.Module, trainable_only: bool = False):
        self.model, self.trainable_only = model, trainable_only

    def _options(self) -> Any:
        # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start); checkpoints only
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.trainable_only else None

    def state_dict(self) -> dict[str, Any]:
        # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start); checkpoints only
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=self._options())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start); checkpoints only
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state, options=self._options())


class OptimizerState:
    """Optimizer state (moments, step counts) keyed by parameter name (layout-free).

    A parameter that has had no gradient yet has no state (a branch the training never runs,
    such as HunyuanVideo 1.5's image embedder, or has not run yet): the checkpoint holds none for it, and a resume must leave it without state too, so that its
    first gradient starts its moments and step count as in the uninterrupted run."""

    sharded, optional = True, False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start); checkpoints only
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def stored_only(self, state: dict[str, Any], stored: set[str]) -> dict[str, Any]:
        """`state` (this part's loading template: every parameter with state, as torch
        initialises it) cut to the parameters the checkpoint holds state for; `stored`: the
        checkpoint's keys of this part ("state.<parameter name>.<field>", "param_groups...")."""
        held = {k[len("state."):].rsplit(".", 1)[0] for k in stored if k.startswith("state.")}
        return {**state, "state": {name: v for name, v in state["state"].items() if name in held}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # not strict: the parameters stored_only() left out get no state (torch's strict load
        # would refuse them)
        # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start); checkpoints only
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(strict=False))


class JSONState:
    """A small object (LR scheduler, trainer counters) stored as JSON."""

    sharded = False

    def __init__(self, obj: Any, optional: bool = False):
        self.obj, self.optional = obj, optional

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


def training_parts(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, trainer: Any,
                   trainable_only: bool = False) -> dict[str, Part]:
    """The parts every training run has (more are added by the features that need them)."""
    return {"model": ModelState(model, trainable_only), "optim": OptimizerState(model, optimizer),
            "scheduler": JSONState(scheduler), "trainer": JSONState(trainer)}
