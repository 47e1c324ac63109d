"""Which queries of a packed sequence attend to which keys, as per-sample blocks.

Ring attention (and any permuted layout) attends a set of query tokens to a set of key tokens
that are pieces of one pack: token i of the queries sees key j when both belong to the same
sample and, if causal, pos_k[j] <= pos_q[i] (exactly `attention.attention_mask`). Instead of
that dense [Lq, Lk] mask, `sample_blocks` lists one block per sample present on both sides —
the sample's queries (gathered by index: under the zigzag split they need not be contiguous)
against its keys — so a kernel costs Σ_b nq_b·nk_b, not Lq·Lk, and never scores two samples
against each other.

Each block keeps only what can be seen: queries that see no key of this set are dropped (their
result is "nothing": out 0, lse = MASKED), and since keys are sorted by position a causal query
sees a prefix of its sample's keys, so keys beyond the last query's prefix are dropped too. What
is left is one of three kinds:
  full    every kept query sees every kept key (bidirectional; causal keys that all precede);
  causal  the same positions on both sides (the rank's own tokens): query i sees keys 0..i;
  masked  any other staircase; the kernel builds the block's [nq, nk] mask from positions.
Under the contiguous and zigzag CP splits of token-causal packs only `full` and `causal` occur (a
ring rank's pieces of a sample are either the same tokens or wholly before / after each other).
Block-causal packs (video, equal positions within a temporal block) give `masked` blocks: the
counts below take ties as seen (searchsorted right), and `causal` is only chosen when query i
sees exactly keys 0..i, which equal positions rule out, so no is_causal kernel sees them.

Blocks of the same (kind, nq, nk) are neighbours in the plan, so a kernel serves them with one
batched call ([count, nq, H, D]).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dit_train.kernels.eager import eager

KINDS = ("full", "causal", "masked")


@dataclass(frozen=True)
class BlockGroup:
    """`count` blocks of one kind and shape: rows [start_q, start_q + count·nq) of the gathered
    queries and [start_k, start_k + count·nk) of the gathered keys, block after block."""

    kind: str
    count: int
    nq: int
    nk: int
    start_q: int
    start_k: int


@dataclass
class SampleBlocks:
    """The per-sample blocks of one (query set, key set) pair.

    q_index: [Nq] rows of the query set, block after block (Nq = queries that see a key).
    k_index: [Nk] rows of the key set, block after block (a key appears in at most one block).
    pos_q / pos_k: [Nq] / [Nk] in-sample positions of those rows (for `masked` blocks' masks).
    seg_q / seg_k: [Nq] / [Nk] the block number of each row (flex's document mask).
    rows: [Lq] where each query row's result is in the gathered output; Nq (one past the end)
        for a row that sees no key here.
    groups: runs of blocks of one kind and shape, in plan order.
    causal: whether the pair was planned with the causal rule (flex's mask needs it).
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    pos_q: torch.Tensor
    pos_k: torch.Tensor
    seg_q: torch.Tensor
    seg_k: torch.Tensor
    rows: torch.Tensor
    groups: list[BlockGroup]
    causal: bool
    num_queries: int
    # what a kernel derives once per plan and reuses in every layer (flex's block mask)
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def empty(self) -> bool:
        """No query sees any key: a ring step with this plan can be skipped."""
        return not self.groups

    @property
    def covered(self) -> int:
        return int(self.q_index.numel())

    def score_elements(self) -> int:
        """Σ over blocks of nq·nk: the scores a kernel that materialises each block holds (per head)."""
        return sum(g.count * g.nq * g.nk for g in self.groups)

    def to(self, device: torch.device | str) -> "SampleBlocks":
        moved = {name: getattr(self, name).to(device)
                 for name in ("q_index", "k_index", "pos_q", "pos_k", "seg_q", "seg_k", "rows")}
        return SampleBlocks(**moved, groups=self.groups, causal=self.causal, num_queries=self.num_queries)


def _sorted_by_sample(seg: torch.Tensor, pos: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, key): the rows sorted by (sample, position), and key = seg·span + pos sorted."""
    key = seg * span + pos
    order = torch.argsort(key, stable=True)
    return order, key[order]


@eager  # host-side planning (.tolist(), data-dependent sizes): never traced by torch.compile
def sample_blocks(seg_q: torch.Tensor, pos_q: torch.Tensor, seg_k: torch.Tensor, pos_k: torch.Tensor,
                  causal: bool) -> SampleBlocks:
    """The per-sample blocks of queries (seg_q, pos_q: [Lq]) against keys (seg_k, pos_k: [Lk]).

    Computed on the host (one pass, a few syncs): call it once per pack and pair of token sets,
    and reuse the plan in every layer. Returns CPU tensors (`SampleBlocks.to` moves them).
    """
    seg_q, pos_q, seg_k, pos_k = (t.detach().cpu().long() for t in (seg_q, pos_q, seg_k, pos_k))
    Lq = seg_q.numel()
    span = int(max(pos_q.max() if Lq else 0, pos_k.max() if seg_k.numel() else 0)) + 1
    oq, kq = _sorted_by_sample(seg_q, pos_q, span)
    ok, kk = _sorted_by_sample(seg_k, pos_k, span)
    sq = seg_q[oq]
    # the keys of each query's sample are kk[first:last]; those it may see are kk[first:last_seen]
    first = torch.searchsorted(kk, sq * span)
    last = torch.searchsorted(kk, sq * span + span)
    seen = torch.searchsorted(kk, kq, right=True) if causal else last
    count = seen - first  # keys each sorted query sees (0 where its sample has none here)
    keep = count > 0
    # queries of a sample are sorted by position, so the ones that see something are a suffix
    # of the sample's run and their counts do not decrease along it
    rows_kept = torch.nonzero(keep).flatten()
    blocks = []  # (kind, nq, nk, query start in sorted order, key start in sorted order)
    if rows_kept.numel():
        ids, nqs = torch.unique_consecutive(sq[rows_kept], return_counts=True)
        starts = torch.cumsum(nqs, 0) - nqs
        for b_first, nq in zip(rows_kept[starts].tolist(), nqs.tolist()):
            c = count[b_first:b_first + nq]
            nk = int(c[-1])
            if int(c[0]) == nk:
                kind = "full"
            elif nq == nk and bool(torch.equal(c, torch.arange(1, nq + 1))):
                kind = "causal"
            else:
                kind = "masked"
            blocks.append((kind, nq, nk, b_first, int(first[b_first])))
    # neighbours of one kind and shape: one batched kernel call each
    blocks.sort(key=lambda b: (KINDS.index(b[0]), b[1], b[2]))
    groups: list[BlockGroup] = []
    qs, ks = [], []
    nq_total = nk_total = 0
    for kind, nq, nk, q0, k0 in blocks:
        g = groups[-1] if groups else None
        if g is not None and (g.kind, g.nq, g.nk) == (kind, nq, nk):
            groups[-1] = BlockGroup(kind, g.count + 1, nq, nk, g.start_q, g.start_k)
        else:
            groups.append(BlockGroup(kind, 1, nq, nk, nq_total, nk_total))
        qs.append(torch.arange(q0, q0 + nq))
        ks.append(torch.arange(k0, k0 + nk))
        nq_total += nq
        nk_total += nk
    empty = torch.zeros(0, dtype=torch.long)
    q_sorted = torch.cat(qs) if qs else empty  # positions in the sorted query order
    k_sorted = torch.cat(ks) if ks else empty
    block_q = torch.repeat_interleave(torch.arange(len(blocks)), torch.tensor([b[1] for b in blocks], dtype=torch.long))
    block_k = torch.repeat_interleave(torch.arange(len(blocks)), torch.tensor([b[2] for b in blocks], dtype=torch.long))
    q_index, k_index = oq[q_sorted], ok[k_sorted]
    rows = torch.full((Lq,), nq_total, dtype=torch.long)
    rows[q_index] = torch.arange(nq_total)
    return SampleBlocks(q_index=q_index, k_index=k_index, pos_q=pos_q[q_index], pos_k=pos_k[k_index],
                        seg_q=block_q, seg_k=block_k, rows=rows, groups=groups, causal=causal, num_queries=Lq)
