"""Activation offload (`train.activation_offload`): the tensors a forward saves for backward
are copied to host memory when saved and back when backward needs them.

Like `torch.autograd.graph.save_on_cpu` (pinned host buffers on CUDA), with three differences:
- whole storages are copied, once each, and tensors are restored as the same views of them
  (size, stride, offset): backward then sees exactly the layouts it would have seen, so the
  result is bit-identical to a run without offload (save_on_cpu restores contiguous copies,
  which changes strides and with them the summation order of some kernels), and a storage
  saved by several ops (a block's input, q/k/v views of one projection) crosses PCIe once;
- parameters stay where they are: under FSDP2 the linear layers save the gathered block
  weights, which FSDP frees and re-gathers itself;
- on a CPU run the host copy is still made (the code path is exercised; no memory is saved).

Inside activation-checkpointed blocks the checkpoint's own hooks take precedence: such a block
offloads nothing but its inputs (under the selective policy its cached matmul outputs stay on
the device).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef


class offload_activations(torch.autograd.graph.saved_tensors_hooks):
    """Context: saved tensors (not parameters) go to host memory; `pin_memory` on CUDA."""

    def __init__(self, pin_memory: bool):
        # (storage, version) -> (weak ref pinning the storage's identity, host bytes); storages
        # are told apart by their StorageImpl, which the weak ref keeps from being reused
        host_of: dict[tuple[int, int], tuple[StorageWeakRef, torch.Tensor]] = {}
        # host buffer -> its device copy while some restored tensor still uses it
        device_of: dict[int, StorageWeakRef] = {}

        def pack(t: torch.Tensor) -> Any:
            if isinstance(t, nn.Parameter) or t.layout != torch.strided:
                return t
            st = t.untyped_storage()
            ref = StorageWeakRef(st)
            key = (ref.cdata, t._version)
            if key not in host_of:
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin_memory)
                host.untyped_storage().copy_(st)
                host_of[key] = (ref, host)
            return t.device, t.dtype, t.size(), t.stride(), t.storage_offset(), host_of[key][1]

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, dtype, size, stride, offset, host = packed
            ref = device_of.get(id(host))
            if ref is None or ref.expired():
                storage = host.to(device, non_blocking=pin_memory).untyped_storage()
                device_of[id(host)] = StorageWeakRef(storage)
            else:
                storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)

        super().__init__(pack, unpack)


def activation_offload(enabled: bool, device: torch.device):
    """`offload_activations` when `enabled` (pinned buffers on CUDA), else a no-op context."""
    return offload_activations(pin_memory=device.type == "cuda") if enabled else contextlib.nullcontext()
