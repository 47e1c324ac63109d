"""Context parallelism for packed sequences: Ulysses, ring, and their hybrid.

A pack of L tokens is split over cp = cp_ring × cp_ulysses ranks (batch.cp_token_index);
rank c = r·cp_ulysses + u holds chunk c. Inside every attention layer:

1. Ulysses (group of the cp_ulysses ranks sharing r): an all-to-all trades heads for
   sequence, so each rank holds H/cp_ulysses heads of the tokens of all its group's chunks.
2. Ring (group of the cp_ring ranks sharing u): queries stay, K/V blocks travel around the
   ring; each block's partial attention and log-sum-exp are merged exactly (online softmax).
   A ring step computes only the sample-diagonal blocks (each sample's local queries against
   the visiting keys of the same sample, gathered by index, `kernels.sample_blocks`), so it
   costs Σ over samples, not (L/cp_ring)²; a step in which no query sees a key is skipped.
   `model.attn_backend=sdpa_dense` selects the dense [Lq, Lk] mask per step instead (the
   reference; its memory grows with the pack's length squared).
   With cp_ring = 1 the whole pack is local after step 1 and the fast varlen kernel runs.
3. The inverse all-to-all restores the rank's tokens with all heads.

All communication goes through autograd-aware functional collectives
(`all_to_all_single_autograd`), so the backward pass is the exact transpose of the forward.
Masks come from the full pack's sample ids and in-sample order (metadata every rank has);
the split itself never looks at sample boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from dit_train.batch import PackedBatch, cp_token_index
from dit_train.kernels import (SampleBlocks, VarlenLayout, attention_mask, attention_with_lse, block_attention_with_lse,
                               merge_partials, sample_blocks, varlen_attention)


@dataclass
class CPAttnLayout:
    """Attention metadata of one CP-split pack (identical on every rank of the CP group).

    seg / order: [L] of the full pack (order: its causal key, `PackedBatch.mask_order`: the
    in-sample index, or the temporal block of block-causal video); index[c]: [L/cp] token indices
    held by CP rank c. stream: [L] the full pack's `PackedBatch.stream` (None = one stream), for a
    model that derives per-stream layouts (`restricted`); key_seg: [L] the keys' own segment ids
    when they differ from the queries' (kernels.VarlenLayout.key_seg), else None; full_pos: [L, A] the
    full pack's positions (None = not kept), for a model whose tokens' coordinates depend on their
    whole clip (MiniMax-H3's aspect-normalised grid) while a rank holds part of it.
    """

    seg: torch.Tensor
    order: torch.Tensor
    causal: bool
    index: list[torch.Tensor]
    stream: torch.Tensor | None = None
    key_seg: torch.Tensor | None = None
    full_pos: torch.Tensor | None = None
    # what the first attention layer derives from the layout (host syncs) and the others reuse:
    # ("blocks", query ring rank, key ring rank) -> SampleBlocks of that ring step;
    # ("visible", ...) -> bool, for the dense reference; ("local", ...) -> the Ulysses VarlenLayout
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def to(self, device: torch.device | str) -> "CPAttnLayout":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return CPAttnLayout(self.seg.to(device), self.order.to(device), self.causal, [i.to(device) for i in self.index],
                            move(self.stream), move(self.key_seg), move(self.full_pos))

    def restricted(self, seg: torch.Tensor, key_seg: torch.Tensor | None = None) -> "CPAttnLayout":
        """The same split with other segment ids [L] of the full pack (and the keys' own, `key_seg`):
        kernels.VarlenLayout.restricted under CP."""
        return CPAttnLayout(seg, self.order, self.causal, self.index, self.stream, key_seg, self.full_pos)

    def keys(self) -> torch.Tensor:
        """[L] the keys' segment ids."""
        return self.seg if self.key_seg is None else self.key_seg


def split_for_cp(batch: PackedBatch, cp: int, cp_rank: int, layout: str) -> tuple[PackedBatch, CPAttnLayout]:
    """Pad the full pack to a multiple of cp (2·cp for zigzag) and take this rank's tokens."""
    multiple = 2 * cp if layout == "zigzag" else cp
    full = batch.pad_to_multiple(multiple)
    L = full.num_tokens
    index = [cp_token_index(L, cp, c, layout).to(full.seg.device) for c in range(cp)]
    meta = CPAttnLayout(seg=full.seg, order=full.mask_order, causal=full.causal, index=index, stream=full.stream,
                        full_pos=full.pos)
    return full.select(index[cp_rank]), meta


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (x.shape[0] divisible by the group size n)."""
    sizes = [x.shape[0] // n] * n
    return all_to_all_single_autograd(x.contiguous(), sizes, sizes, group)


def _ring_shift(x: torch.Tensor, group: dist.ProcessGroup, rank: int, n: int) -> torch.Tensor:
    """Send x to ring rank (rank+1) % n, receive from (rank-1) % n (an all-to-all with one
    non-empty split each way, so autograd sends gradients back the other way)."""
    m = x.shape[0]
    send = [m if j == (rank + 1) % n else 0 for j in range(n)]
    recv = [m if j == (rank - 1) % n else 0 for j in range(n)]
    return all_to_all_single_autograd(x.contiguous(), recv, send, group)


class ContextParallelAttention:
    """Drop-in replacement for `dit_train.kernels.LocalAttention` under CP.

    __call__(q, k, v, meta: CPAttnLayout) with q, k, v [L/cp, H, D] (this rank's tokens, all
    heads) returns [L/cp, H, D].
    ulysses_group / ring_group: this rank's process groups along cp_ulysses / cp_ring (None = 1).
    """

    def __init__(self, ulysses_group, ulysses_size: int, ulysses_rank: int,
                 ring_group, ring_size: int, ring_rank: int, backend: str):
        self.ug, self.U, self.u = ulysses_group, ulysses_size, ulysses_rank
        self.rg, self.R, self.r = ring_group, ring_size, ring_rank
        self.backend = backend
        # ring blocks (query block x K/V block) computed and skipped as fully masked, since creation
        self.ring_blocks = {"computed": 0, "skipped": 0}

    def _ring_tokens(self, meta: CPAttnLayout, ring_rank: int) -> torch.Tensor:
        """Pack indices of the tokens held (after Ulysses) by the ranks of ring position r."""
        return torch.cat([meta.index[ring_rank * self.U + j] for j in range(self.U)])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CPAttnLayout) -> torch.Tensor:
        Lc, H, D = q.shape
        if H % self.U:
            raise ValueError(f"{H} heads cannot be split over parallel.cp_ulysses={self.U}")
        qkv = torch.stack([q, k, v])  # [3, Lc, H, D]
        if self.U > 1:
            # heads -> destination rank: [U, 3, Lc, H/U, D]; receive [U(src), 3, Lc, H/U, D]
            x = qkv.view(3, Lc, self.U, H // self.U, D).permute(2, 0, 1, 3, 4)
            x = _all_to_all(x, self.ug, self.U)
            qkv = x.permute(1, 0, 2, 3, 4).reshape(3, self.U * Lc, H // self.U, D)
        q, k, v = qkv.unbind(0)
        mine = self._ring_tokens(meta, self.r)
        if self.R == 1:
            out = self._local(q, k, v, meta, mine)
        else:
            out = self._ring(q, k, v, meta, mine)
        if self.U > 1:
            # back: [U(dst), Lc, H/U, D] -> receive [U(src head group), Lc, H/U, D] -> [Lc, H, D]
            x = _all_to_all(out.view(self.U, Lc, H // self.U, D), self.ug, self.U)
            out = x.permute(1, 0, 2, 3).reshape(Lc, H, D)
        return out

    def _local(self, q, k, v, meta: CPAttnLayout, idx: torch.Tensor) -> torch.Tensor:
        """Whole pack local (cp_ring = 1): restore pack order, run the varlen kernel, undo.
        q, k, v: [L, H/cp_ulysses, D] in the order of `idx` (pack indices) -> [L, H/cp_ulysses, D]."""
        perm = torch.argsort(idx)
        key = ("local", self.r, str(q.device))
        if key not in meta.cache:  # one layout per pack, not per layer (it syncs with the host)
            sorted_idx = idx[perm]
            local = VarlenLayout.build(meta.seg[sorted_idx], meta.order[sorted_idx], meta.causal)
            meta.cache[key] = local if meta.key_seg is None else local.restricted(local.seg, meta.key_seg[sorted_idx])
        out_sorted = varlen_attention(q[perm], k[perm], v[perm], meta.cache[key], self.backend)
        out = torch.empty_like(out_sorted)
        out[perm] = out_sorted
        return out

    def _blocks(self, meta: CPAttnLayout, idx_q: torch.Tensor, src: int, device: torch.device) -> SampleBlocks:
        """The per-sample blocks of this rank's queries against ring position `src`'s keys,
        planned by the first layer of the pack and reused by the others."""
        key = ("blocks", self.r, src, str(device))
        if key not in meta.cache:
            idx_k = self._ring_tokens(meta, src)
            meta.cache[key] = sample_blocks(meta.seg[idx_q], meta.order[idx_q], meta.keys()[idx_k], meta.order[idx_k],
                                            meta.causal).to(device)
        return meta.cache[key]

    def _dense_step(self, q, kv, meta: CPAttnLayout, idx_q: torch.Tensor, src: int):
        """The reference ring step (model.attn_backend=sdpa_dense): one [Lq, Lk] mask and score
        block over the whole local chunk. Returns (out, lse), or None when no query sees a key."""
        idx_k = self._ring_tokens(meta, src)
        mask = attention_mask(meta.seg[idx_q], meta.order[idx_q], meta.keys()[idx_k], meta.order[idx_k], meta.causal)
        key = ("visible", self.r, src)
        if key not in meta.cache:
            meta.cache[key] = bool(mask.any())
        # step 0 (own keys) holds each query's own token
        return attention_with_lse(q, kv[0], kv[1], mask) if src == self.r or meta.cache[key] else None

    def _ring(self, q, k, v, meta: CPAttnLayout, idx_q: torch.Tensor) -> torch.Tensor:
        """Queries stay; K/V (with their ring origin) rotate R-1 times; merge by LSE.
        q, k, v: [Lq, H/cp_ulysses, D] (this ring position's tokens, `idx_q` their pack indices).
        The K/V shifts are all-to-alls over the ring group (self.rg)."""
        kv = torch.stack([k, v])
        outs, lses = [], []
        for step in range(self.R):
            src = (self.r - step) % self.R
            if self.backend == "sdpa_dense":
                part = self._dense_step(q, kv, meta, idx_q, src)
            else:
                plan = self._blocks(meta, idx_q, src, q.device)
                # an empty plan is skipped, except at step 0 of a layout with its own key ids (a rank
                # may hold video queries and no audio key): zero rows at MASKED start the merge
                skip = plan.empty and (bool(outs) or meta.key_seg is None)
                part = None if skip else block_attention_with_lse(q, kv[0], kv[1], plan, self.backend)
            if part is not None:  # never None at step 0: each query sees its own token
                outs.append(part[0])
                lses.append(part[1])
                self.ring_blocks["computed"] += 1
            else:
                # No query may see this block (other samples, or later in causal order): skip
                # it. Its K/V still enter the graph through an exact zero, so every rank's
                # backward ring issues the same collectives as its neighbours' (a block left out
                # of the graph on some ranks only deadlocked the ring).
                outs[-1] = outs[-1] + 0.0 * kv.sum()
                self.ring_blocks["skipped"] += 1
            if step < self.R - 1:
                kv = _ring_shift(kv, self.rg, self.r, self.R)
        return merge_partials(outs, lses)
