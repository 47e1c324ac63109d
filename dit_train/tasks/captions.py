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

import hashlib
import math

import torch

from dit_train.rng import sample_generator

_EMPTY = 256  # table row of the empty caption (the "null" token used for dropout and CFG)


class ByteCaptionEncoder:
    """UTF-8 bytes of a caption -> [min(len, max_len) or 1, text_dim] float32 (deterministic).

    words: every byte also carries a fixed vector of the whole (space-separated) word it is in,
    seeded by the word's bytes. The context embedder works byte by byte, so without it a word
    is only a pattern of bytes at positions, which cross-attention must learn to spell out
    ("green" and "gray" share "gr"); with it each word is one key (`model.caption_words`)."""

    def __init__(self, text_dim: int, max_len: int, seed: int = 0, words: bool = False):
        self.text_dim, self.seed, self.words = text_dim, seed, words
        self._word_vectors: dict[bytes, torch.Tensor] = {}
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(257, text_dim, generator=gen)
        self.max_len = max_len
        half = text_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / max(half, 1))
        angles = torch.arange(max_len, dtype=torch.float32)[:, None] * freqs[None]
        pos = torch.zeros(max_len, text_dim)
        pos[:, :half], pos[:, half:2 * half] = torch.sin(angles), torch.cos(angles)
        self.pos = pos

    def word_vector(self, word: bytes) -> torch.Tensor:
        """[text_dim] N(0, 1) vector of a word, a pure function of (seed, word bytes)."""
        vec = self._word_vectors.get(word)
        if vec is None:
            digest = hashlib.blake2b(word, digest_size=8, key=str(self.seed).encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
            vec = self._word_vectors[word] = torch.randn(self.text_dim, generator=gen)
        return vec

    def __call__(self, caption: str) -> torch.Tensor:
        raw = caption.encode("utf-8")
        ids = list(raw)[: self.max_len] or [_EMPTY]
        out = self.table[torch.tensor(ids)] + self.pos[: len(ids)]
        if self.words and raw:
            start = 0
            for word in raw.split(b" "):  # word spans of the whole caption, cut at max_len
                end = start + len(word)
                if word and start < len(ids):
                    out[start:min(end, len(ids))] += self.word_vector(word)
                start = end + 1
        return out


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
