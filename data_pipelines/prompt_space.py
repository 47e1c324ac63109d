"""How a user's prompts and clip sizes become model inputs: a `PromptSpace`. A source whose
samples are not the pixels its task trains on answers `DataSource.prompt_space` with its own (a
latent cache: its text encoder encodes the prompt, its VAE maps sizes to the latent grid and
decodes the samples); for the others, sampling/prompts.py builds the pixel space of the task."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)


@dataclass
class PromptSpace:
    """How prompts and sizes become model inputs for one run.

    encode: caption -> [Lt, text_dim] (None for an unconditional model); null: the empty caption.
    shape: (frames, height, width) in pixels -> (C, F, H, W) in model space.
    decode: model-space clip -> pixels [3, F, H, W] in [-1, 1] (None: already pixels).
    """

    encode: Callable[[str], torch.Tensor] | None
    null: torch.Tensor | None
    shape: Callable[[int, int, int], tuple[int, int, int, int]]
    decode: Callable[[torch.Tensor], torch.Tensor] | None
    fps: float


def fit_to_patch(x: int, m: int, what: str) -> int:
    """`x` cut down to a multiple of the patch `m` (at least one patch), with a warning when cut."""
    y = max(m, x - x % m)
    if y != x:
        log.warning("%s=%d is not a multiple of the model's patch %d: using %d", what, x, m, y)
    return y


def notice_cut(caption: str, length: int, keep: int, unit: str) -> None:
    """Say so when a prompt is longer than the model reads (model.text_len): the rest is ignored."""
    if length > keep:
        shown = caption if len(caption) <= 40 else caption[:40] + "..."
        log.warning("the prompt %r is %d %s long; the model reads the first %d (model.text_len=%d), the rest is "
                    "ignored", shown, length, unit, keep, keep)
