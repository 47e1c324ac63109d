"""The packed micro-batch that flows from data to model, and its split across CP ranks."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class PackedBatch:
    """Several samples concatenated into one flat sequence of L tokens.

    seg:    [L] int64  index of the token's sample in this pack (0..S-1); -1 = padding
    pos:    [L, A] int64  RoPE coordinates (A = 3: t, h, w for video; A = 1 for text)
    order:  [L] int64  index of the token inside its sample (causal mask, contiguity check)
    valid:  [L] bool   token carries loss (padding, prompt and ignored labels do not)
    tokens: token-aligned tensors, each [L, ...] (video: x, target; text: ids, labels)
    samples: per-sample tensors, each [S, ...] (video: t); identical on every CP rank
    sample_ids: [S] int64  dataset ids (keys of the per-sample noise and metadata)
    causal: attention is causal inside each sample
    """

    seg: torch.Tensor
    pos: torch.Tensor
    order: torch.Tensor
    valid: torch.Tensor
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    causal: bool = False

    @property
    def num_tokens(self) -> int:
        return self.seg.numel()

    @property
    def num_samples(self) -> int:
        return self.sample_ids.numel()

    def to(self, device: torch.device | str) -> "PackedBatch":
        mv = lambda d: {k: v.to(device, non_blocking=True) for k, v in d.items()}  # noqa: E731
        return replace(self, seg=self.seg.to(device), pos=self.pos.to(device), order=self.order.to(device),
                       valid=self.valid.to(device), tokens=mv(self.tokens), samples=mv(self.samples),
                       sample_ids=self.sample_ids.to(device))

    def pad_to_multiple(self, m: int) -> "PackedBatch":
        """Append padding tokens (seg -1, weight 0) so L is a multiple of m (at least m)."""
        L = self.num_tokens
        n = (-L) % m if L > 0 else m
        if n == 0:
            return self

        def pad(t: torch.Tensor, value=0) -> torch.Tensor:
            return torch.cat([t, t.new_full((n, *t.shape[1:]), value)])

        # padding is one more "sample" (id -1) with its own in-order positions, so causal and
        # bidirectional kernels agree on it too (its tokens carry weight 0 anyway)
        order = torch.cat([self.order, torch.arange(n, dtype=self.order.dtype)])
        return replace(self, seg=pad(self.seg, -1), pos=pad(self.pos), order=order,
                       valid=pad(self.valid, False), tokens={k: pad(v) for k, v in self.tokens.items()})

    def select(self, index: torch.Tensor) -> "PackedBatch":
        """The tokens at `index` (a CP shard); per-sample tensors are kept whole."""
        return replace(self, seg=self.seg[index], pos=self.pos[index], order=self.order[index],
                       valid=self.valid[index], tokens={k: v[index] for k, v in self.tokens.items()})

    def local_counts(self) -> torch.Tensor:
        """[S] valid tokens of each sample among this batch's tokens (a CP shard sees a part)."""
        seg = self.seg[self.valid]
        return torch.bincount(seg, minlength=self.num_samples)[: self.num_samples]


def cp_token_index(L: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Token indices of the pack held by CP rank `rank` of `cp`.

    contiguous: rank r holds [r·L/cp, (r+1)·L/cp) — bidirectional attention costs the same anywhere.
    zigzag: the pack is cut into 2·cp chunks and rank r holds chunks r and 2·cp-1-r, so that
    under a causal mask every rank has the same amount of attention work.
    The split never looks at sample boundaries: a sample may span ranks; who holds which of its
    tokens is known through `seg`, and per-sample lengths are summed over the CP group.
    """
    if layout == "contiguous":
        if L % cp:
            raise ValueError(f"pack length {L} is not a multiple of the CP degree {cp}")
        n = L // cp
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        if L % (2 * cp):
            raise ValueError(f"pack length {L} is not a multiple of 2·CP = {2 * cp}")
        n = L // (2 * cp)
        a, b = rank, 2 * cp - 1 - rank
        return torch.cat([torch.arange(a * n, (a + 1) * n), torch.arange(b * n, (b + 1) * n)])
    raise ValueError(f"unknown CP layout {layout!r}")
