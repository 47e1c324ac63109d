"""Random latent clips held in memory: what the GPU check trains the real trainer on.

The check runs on a bare machine with no video files and no reader (decord, PyAV): the trainer's
`VideoTask` takes any dataset that gives `.pixels` [C, F, H, W] and `.caption` by sample id and
its token counts by `.lengths()`, so random latents of chosen sizes exercise every step of a
training step (packing, metadata sync, loss reduction, backward, gradient sync, optimizer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dit_train.tasks.video import VideoTask, num_patches


@dataclass
class LatentClip:
    pixels: torch.Tensor  # [C, F, H, W]
    caption: str


class RandomLatents:
    """Clips of shape [channels, F, H, W] for each (F, H, W) of `shapes`; clip i is a pure
    function of (seed, i), so every layout reads the same data."""

    def __init__(self, shapes: Sequence[tuple[int, int, int]], channels: int, patch: tuple[int, int, int], seed: int = 0):
        self.shapes, self.channels, self.patch, self.seed = list(shapes), channels, tuple(patch), seed

    def __len__(self) -> int:
        return len(self.shapes)

    def lengths(self) -> list[int]:
        return [num_patches((self.channels, *s), self.patch) for s in self.shapes]

    def __getitem__(self, i: int) -> LatentClip:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return LatentClip(torch.randn(self.channels, *self.shapes[i], generator=g), f"clip {i}")


def grid_shapes(patch: Sequence[int], grids: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Latent (F, H, W) whose patch grids are `grids` (tokens per clip = the grid's product)."""
    return [tuple(g * p for g, p in zip(grid, patch)) for grid in grids]  # type: ignore[misc]


def latent_task(cfg, grids: Sequence[tuple[int, int, int]], seed: int = 0) -> VideoTask:
    """The trainer's video task over random latents whose patch grids are `grids`, for the model
    and loss of `cfg` (a composed Config)."""
    m = cfg.model
    data = RandomLatents(grid_shapes(m.patch_size, grids), m.in_channels, tuple(m.patch_size), seed)
    return VideoTask(data, m, cfg.loss, cfg.train.seed)


def tokens(grids: Sequence[tuple[int, int, int]]) -> list[int]:
    return [math.prod(g) for g in grids]
