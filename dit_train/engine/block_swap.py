"""Block swap (`model.block_swap=N`): the frozen weights of the last N transformer blocks live in
host memory (pinned on CUDA) and are copied to the device just ahead of each block's forward and
backward, so a LoRA run holds only two of those blocks' weights on the device at a time.

Per swapped block k (in forward order):
- forward pre-hook: make k resident (wait for its copy), evict every other swapped block but
  k + 1, start copying k + 1 (prefetch);
- forward post-hook: a gradient hook on the block's output, which fires in backward before the
  block's own backward (and before activation checkpointing recomputes it): make k resident,
  evict every other but k - 1, start copying k - 1.
"Resident" parameters hold a device copy of their host tensor; evicted ones hold a 0-element
placeholder, so a use that the hooks did not announce fails loudly instead of reading stale data.
The swap replaces the module's parameter (`setattr(module, name, ...)`), not its `.data`: a
quantized base weight (model.base_quant, a torchao tensor subclass: int8, fp8, fp8_scaled, nf4)
keeps its codes and scales in inner tensors that `.data =` leaves in place (only the wrapper's
shape changes: the weight stayed whole where it was and a forward on it still ran), and
torchao's NF4Tensor takes neither `.to(copy=True)` nor `clone` with its own block sizes. Copies
therefore go through the tensor-subclass protocol (`__tensor_flatten__` / `__tensor_unflatten__`,
what FSDP2 and torch.compile use): each inner tensor is copied (pinned, non-blocking) and the
subclass rebuilt around the copies.
On CUDA the copies run on a side stream, ordered by an event the compute stream waits on, and
each device copy is recorded on the compute stream (the allocator keeps it until the kernels
using it are done); on the CPU the same code runs with plain copies (nothing is saved: it is
there so that the path is tested).

Why full activation checkpointing on the swapped blocks (check_config requires it): without it a
linear layer saves views of its weight for backward, which keep every evicted device copy alive
until backward; with it a block saves only its inputs and recomputes with the weights the
backward hook brought back.

Only frozen parameters move (a LoRA run's base): trainable ones (the adapters) stay on the
device, where the optimizer and the gradients are. No collective: one process (check_config
refuses it over several ranks; FSDP2 owns its parameters' storage, parallel.cpu_offload there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def map_storage(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fn` applied to each plain tensor holding `t`'s values: `t` itself, or for a tensor subclass
    (torchao's quantized weights) each inner tensor of `__tensor_flatten__`, the subclass rebuilt
    around the results (its shape, dtype and metadata unchanged)."""
    if not is_traceable_wrapper_subclass(t):
        return fn(t)
    names, meta = t.__tensor_flatten__()
    inner = {n: map_storage(getattr(t, n), fn) for n in names}
    return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())


def leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s values (see map_storage)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [x for n in t.__tensor_flatten__()[0] for x in leaves(getattr(t, n))]


def held_bytes(module: nn.Module) -> int:
    """Bytes of values the frozen parameters of `module` hold now (a quantized weight: its codes
    and scales; an evicted one: 0)."""
    return sum(x.numel() * x.element_size() for p in module.parameters() if not p.requires_grad for x in leaves(p))


@dataclass
class _Block:
    slots: list[tuple[nn.Module, str]]  # (module, parameter name) of each frozen parameter
    host: list[torch.Tensor]  # their values in host memory (pinned on CUDA)
    placeholders: list[nn.Parameter]  # 0-element stand-ins while evicted
    device: list[nn.Parameter] | None = None  # the device copies while resident or arriving
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the side stream after the copy

    def hold(self, params: list[nn.Parameter]) -> None:
        for (m, name), p in zip(self.slots, params):
            if m._parameters[name] is not p:
                setattr(m, name, p)


class BlockSwap:
    """The swap state of `blocks` (the swapped ones, forward order) on `device`; `install` adds
    the hooks. `resident_peak` counts the most blocks on the device at once: those whose frozen
    parameters hold values (`held_bytes`, read from the modules themselves) or whose copy is in
    flight (tests)."""

    def __init__(self, blocks: list[nn.Module], device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.modules = list(blocks)
        self.blocks: list[_Block] = []
        for block in self.modules:
            slots = [(m, n) for m in block.modules() for n, p in m.named_parameters(recurse=False) if not p.requires_grad]
            host = [map_storage(m._parameters[n].detach(), lambda x: x.to("cpu", copy=True)) for m, n in slots]
            if self.cuda:
                host = [map_storage(h, torch.Tensor.pin_memory) for h in host]
            holders = [nn.Parameter(torch.empty(0, dtype=m._parameters[n].dtype, device=self.device), requires_grad=False)
                       for m, n in slots]
            b = _Block(slots, host, holders)
            b.hold(holders)
            self.blocks.append(b)
        self.resident_peak = 0

    # -- copies --------------------------------------------------------------------------------

    def _fetch(self, k: int) -> None:
        """Start copying block k to the device (no-op if it is resident or arriving)."""
        b = self.blocks[k]
        if b.device is not None:
            return
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after its last eviction's users
            with torch.cuda.stream(self.stream):
                b.device = [nn.Parameter(map_storage(h, lambda x: x.to(self.device, non_blocking=True)), requires_grad=False)
                            for h in b.host]
                b.ready = torch.cuda.Event()
                b.ready.record(self.stream)
        else:
            b.device = [nn.Parameter(map_storage(h, torch.clone), requires_grad=False) for h in b.host]

    def _use(self, k: int) -> None:
        """Block k's parameters hold their device copies, ready for the compute stream."""
        self._fetch(k)
        b = self.blocks[k]
        if b.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(b.ready)
            for p in b.device:
                for x in leaves(p):
                    x.record_stream(current)
            b.ready = None
        b.hold(b.device)

    def _evict_all_but(self, keep: set[int]) -> None:
        for k, b in enumerate(self.blocks):
            if k not in keep and b.device is not None:
                b.hold(b.placeholders)
                b.device, b.ready = None, None

    def bring(self, k: int, next_k: int) -> None:
        """Block k in use, `next_k` (the block that runs after it, or -1) on its way, no other."""
        self._use(k)
        nxt = next_k if 0 <= next_k < len(self.blocks) else None
        self._evict_all_but({k} if nxt is None else {k, nxt})
        if nxt is not None:
            self._fetch(nxt)
        # on the device now: what the modules hold, and copies in flight
        on_device = sum(held_bytes(m) > 0 or b.device is not None for m, b in zip(self.modules, self.blocks))
        self.resident_peak = max(self.resident_peak, on_device)

    def release(self) -> None:
        """Evict every block (e.g. after the last backward of a step: nothing swapped stays)."""
        self._evict_all_but(set())

    # -- hooks ---------------------------------------------------------------------------------

    def install(self, modules: list[nn.Module]) -> None:
        """Forward pre/post hooks on `modules` (the swapped blocks as the model calls them, e.g.
        their activation-checkpoint wrappers; same order as the blocks given to __init__)."""
        for k, module in enumerate(modules):
            module.register_forward_pre_hook(self._pre_hook(k))
            module.register_forward_hook(self._post_hook(k))

    def _pre_hook(self, k: int):
        def hook(module, args):
            self.bring(k, k + 1)
        return hook

    def _post_hook(self, k: int):
        def on_grad(grad):
            self.bring(k, k - 1)
            return grad

        def hook(module, args, output):
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(on_grad)
                    break  # one hook per block is enough: its backward starts when any output's grad is in
        return hook

