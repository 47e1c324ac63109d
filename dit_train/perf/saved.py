"""What a forward keeps for backward, measured on any device without an allocator (CPU).

Three views of the same question, each for a different job:

- `saved_tensor_table(out, exclude)`: every tensor the autograd graph behind `out` saved, one
  row per (node, slot): the op that saved it (its backward node's name, e.g.
  `AddmmBackward0.mat1`), shape, dtype, bytes, and whether its storage was already counted (views
  and tensors saved by several ops cost once). The tool for finding what a block saves that it
  need not. Walks `grad_fn.next_functions` and reads each node's `_saved_*` slots (custom
  autograd Functions: `saved_tensors`); call it on graphs without activation checkpointing
  (a checkpointed node's slots would recompute the region when read).
- `retained_bytes(fn)`: bytes of the storages created while `fn()` ran that are still alive
  when it returns — what the step holds at the start of backward. Sees everything that keeps
  memory: tensors saved by autograd, the inputs a checkpoint keeps for its recomputation, and
  the op outputs a selective-checkpoint policy caches (those pass through no saved-tensor
  hook). Autocast's low-precision weight copies are reported apart (`weight_copies`): they
  are per parameter, not per token.
- `dit_train.perf.memory.saved_activation_bytes(fn)`: the saved-tensor-hook count (the
  planner's historical calibration; equal to `retained_bytes` without checkpointing).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dit_train.parallel.checkpointing import apply_activation_checkpointing


@dataclass
class SavedTensor:
    op: str  # backward node name and slot, e.g. "AddmmBackward0.mat1"
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes of its storage (a view reports its whole storage)
    counted: bool  # first time this storage appears (the only row whose bytes count)

    def row(self, tokens: int | None = None, dim: int | None = None) -> dict[str, Any]:
        r = {"op": self.op, "shape": "x".join(map(str, self.shape)), "dtype": str(self.dtype).replace("torch.", ""),
             "bytes": self.nbytes if self.counted else 0}
        if tokens and dim:
            r["d_per_token"] = (self.nbytes / tokens / dim / self.dtype.itemsize) if self.counted else 0.0
        return r


def _node_saved(node: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """(slot, tensor) pairs a backward node holds."""
    if hasattr(node, "saved_tensors") and not hasattr(node, "_saved_self"):  # a custom autograd.Function's ctx
        try:
            for i, t in enumerate(node.saved_tensors):
                if isinstance(t, torch.Tensor):
                    yield f"saved[{i}]", t
        except RuntimeError:  # already freed by a backward
            return
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        for i, t in enumerate(values):
            if isinstance(t, torch.Tensor):
                yield name[len("_saved_"):] + (f"[{i}]" if len(values) > 1 else ""), t


def saved_tensor_table(outputs: torch.Tensor | Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()
                       ) -> list[SavedTensor]:
    """Every tensor saved by the graph behind `outputs`, in graph order from the outputs back;
    storages of `exclude` (parameters, inputs) are skipped. Sum `nbytes` of the `counted` rows
    for the total."""
    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen_nodes, seen_storages = set(), set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    rows: list[SavedTensor] = []
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for slot, t in _node_saved(node):
            ptr = t.untyped_storage().data_ptr()
            if ptr in skip or t.untyped_storage().nbytes() == 0:
                continue
            rows.append(SavedTensor(f"{node.name()}.{slot}", tuple(t.shape), t.dtype, t.untyped_storage().nbytes(),
                                    ptr not in seen_storages))
            seen_storages.add(ptr)
        stack.extend(fn for fn, _ in reversed(node.next_functions))
    return rows


class _StorageRecorder(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an op returns, and which of
    them are casts of the given parameters (autocast's weight copies)."""

    def __init__(self, params: set[int]):
        super().__init__()
        self.params = params
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}  # storage -> (weak ref, bytes)
        self.copies: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast_of_param = func is torch.ops.aten._to_copy.default and args and \
            args[0].untyped_storage().data_ptr() in self.params
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                self.refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
                if cast_of_param:
                    self.copies.add(ref.cdata)
        return out


def retained_bytes(fn: Callable[[], Any], params: Iterable[torch.Tensor] = (),
                   exclude: Iterable[torch.Tensor] = ()) -> tuple[dict[str, int], Any]:
    """Run `fn()`; return ({"activations": bytes, "weight_copies": bytes}, fn's result).

    activations: storages that ops returned during fn and that are alive after it returned,
    less the storages of fn's returned tensors (the caller holds those), of `params` and
    `exclude` (views of them: `weight.t()`, `x[None]`) and of casts of `params` (reported as
    weight_copies)."""
    params = list(params)
    rec = _StorageRecorder({p.untyped_storage().data_ptr() for p in params})
    # The collection below is for cycles fn created (they may hold storages): what existed
    # before is frozen out of it. A full collection scans the whole heap — torch, diffusers,
    # transformers once imported: ~0.5 CPU-s a call, most of a tiny calibration's cost.
    # A process that froze its heap itself (tests/pool.py's workers) stays frozen.
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        with rec:
            out = fn()
        gc.collect()
    finally:
        if not frozen_before:
            gc.unfreeze()
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in [*outs, *params, *exclude]}
    act = copies = 0
    for cdata, (ref, n) in rec.refs.items():
        if ref.expired() or cdata in skip:
            continue
        if cdata in rec.copies:
            copies += n
        else:
            act += n
    return {"activations": act, "weight_copies": copies}, out



def bytes_per_token_per_block(build: Callable[[int], torch.nn.Module], forward: Callable[[torch.nn.Module], Any],
                              tokens: int, precision: str = "fp32", policy: str = "none",
                              blocks: Callable[[torch.nn.Module], torch.nn.ModuleList] = lambda m: m.blocks
                              ) -> dict[str, float]:
    """What one transformer block keeps for backward, per token, under an activation
    checkpointing policy: `retained_bytes` of a forward of the model built with depth 2 minus
    depth 1 (whatever lies outside the blocks cancels), divided by `tokens`.

    build(depth) -> a model; forward(model) -> its output for an input of `tokens` tokens
    (built once per depth, so both see the same inputs); precision fp32 or bf16 (CPU autocast).
    Returns bytes per token of the block's activations and of autocast's weight copies
    (per parameter, not per token: reported apart, in bytes per block)."""
    out = []
    for depth in (1, 2):
        model = build(depth)
        apply_activation_checkpointing(blocks(model), policy)
        amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with amp:
            got, result = retained_bytes(lambda: forward(model), list(model.parameters()))
        del result
        out.append(got)
    return {"bytes_per_token": (out[1]["activations"] - out[0]["activations"]) / tokens,
            "weight_copy_bytes": out[1]["weight_copies"] - out[0]["weight_copies"]}
