"""Captions -> embeddings for cross-attention, and the caption dropout that makes CFG possible.

Two sources of caption embeddings [Lt, text_dim]:
  * cached ones from a real text encoder (data=latent_cache stores them per sample), or
  * `ByteCaptionEncoder` for pixel data without a text encoder: a fixed (seeded, untrained)
    table of UTF-8 byte vectors plus sinusoidal positions. The DiT's context embedder and
    cross-attention learn to read it; the embedded synthetic set's captions ("a red circle
    moving right ...") are enough for that.
Caption dropout replaces a sample's caption by the empty caption's embedding, decided by
(seed, sample id, step) alone, so every layout drops the same captions.
"""
from __future__ import annotations

import math

import torch

from dit_train.rng import sample_generator

_EMPTY = 256  # table row of the empty caption (the "null" token used for dropout and CFG)


class ByteCaptionEncoder:
    """UTF-8 bytes of a caption -> [min(len, max_len) or 1, text_dim] float32 (deterministic)."""

    def __init__(self, text_dim: int, max_len: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(257, text_dim, generator=gen)
        self.max_len = max_len
        half = text_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / max(half, 1))
        angles = torch.arange(max_len, dtype=torch.float32)[:, None] * freqs[None]
        pos = torch.zeros(max_len, text_dim)
        pos[:, :half], pos[:, half:2 * half] = torch.sin(angles), torch.cos(angles)
        self.pos = pos

    def __call__(self, caption: str) -> torch.Tensor:
        ids = list(caption.encode("utf-8"))[: self.max_len] or [_EMPTY]
        return self.table[torch.tensor(ids)] + self.pos[: len(ids)]


def drop_caption(seed: int, sample_id: int, step: int, p: float) -> bool:
    """True when the caption of `sample_id` is dropped at `step` (probability p)."""
    if p <= 0:
        return False
    return bool(torch.rand((), generator=sample_generator(seed, sample_id, step, "caption_dropout")) < p)


def pad_contexts(embs: list[torch.Tensor], text_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample [Lt_i, text_dim] -> context [S, max Lt, text_dim] (zero padded), length [S]."""
    lengths = torch.tensor([e.shape[0] for e in embs], dtype=torch.long)
    Lc = max(1, int(lengths.max())) if embs else 1
    out = torch.zeros(len(embs), Lc, text_dim)
    for i, e in enumerate(embs):
        out[i, : e.shape[0]] = e
    return out, lengths
