"""Runs of a packed sequence, shared by the attention kernels.

A pack keeps each sample's tokens together, so its sample ids [L] form a few maximal runs of
equal ids. Neighbouring runs of the same shape can then be viewed as one batch ([count, T, ...])
and served by one batched kernel call instead of `count`.
"""
from __future__ import annotations

from typing import Hashable, TypeVar

import torch

K = TypeVar("K", bound=Hashable)


def run_starts(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seg [L] -> (change [L] bool, True where a new run of equal ids starts;
    starts [R] int64, the indices where it is True)."""
    change = torch.ones(seg.numel(), dtype=torch.bool, device=seg.device)
    change[1:] = seg[1:] != seg[:-1]
    return change, torch.nonzero(change).flatten()


def group_neighbours(keys: list[K]) -> list[tuple[K, int]]:
    """Consecutive equal keys merged, in order: [a, a, b, a] -> [(a, 2), (b, 1), (a, 1)]."""
    groups: list[tuple[K, int]] = []
    for key in keys:
        if groups and groups[-1][0] == key:
            groups[-1] = (key, groups[-1][1] + 1)
        else:
            groups.append((key, 1))
    return groups
