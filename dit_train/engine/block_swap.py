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

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class _Block:
    params: list[nn.Parameter]  # the block's frozen parameters (their .data is swapped)
    host: list[torch.Tensor]  # their values in host memory (pinned on CUDA)
    device: list[torch.Tensor] | None = None  # the device copies while resident or arriving
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the side stream after the copy
    placeholders: list[torch.Tensor] = field(default_factory=list)


class BlockSwap:
    """The swap state of `blocks` (the swapped ones, forward order) on `device`; `install` adds
    the hooks. `resident_peak` counts the most blocks resident at once (tests)."""

    def __init__(self, blocks: list[nn.Module], device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.blocks: list[_Block] = []
        for block in blocks:
            params = [p for p in block.parameters() if not p.requires_grad]
            host = [p.detach().to("cpu", copy=True) for p in params]
            if self.cuda:
                host = [h.pin_memory() for h in host]
            holders = [torch.empty(0, dtype=p.dtype, device=self.device) for p in params]
            for p, h in zip(params, holders):
                p.data = h
            self.blocks.append(_Block(params, host, placeholders=holders))
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
                b.device = [h.to(self.device, non_blocking=True) for h in b.host]
                b.ready = torch.cuda.Event()
                b.ready.record(self.stream)
        else:
            b.device = [h.clone() for h in b.host]

    def _use(self, k: int) -> None:
        """Block k's parameters hold their device copies, ready for the compute stream."""
        self._fetch(k)
        b = self.blocks[k]
        if b.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(b.ready)
            for t in b.device:
                t.record_stream(current)
            b.ready = None
        for p, t in zip(b.params, b.device):
            if p.data.data_ptr() != t.data_ptr() or p.numel() != t.numel():
                p.data = t

    def _evict_all_but(self, keep: set[int]) -> None:
        for k, b in enumerate(self.blocks):
            if k not in keep and b.device is not None:
                for p, h in zip(b.params, b.placeholders):
                    p.data = h
                b.device, b.ready = None, None
        self.resident_peak = max(self.resident_peak, sum(b.device is not None for b in self.blocks))

    def bring(self, k: int, next_k: int) -> None:
        """Block k in use, `next_k` (the block that runs after it, or -1) on its way, no other."""
        self._use(k)
        nxt = next_k if 0 <= next_k < len(self.blocks) else None
        self._evict_all_but({k} if nxt is None else {k, nxt})
        if nxt is not None:
            self._fetch(nxt)

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

