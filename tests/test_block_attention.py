"""Ring attention's per-sample blocks (kernels/blocks.py, kernels/block_attention.py) give the
dense masked reference's (out, lse) and gradients, on uneven samples split the way CP splits
them (contiguous, zigzag) and permuted at random, causal and not, in fp64."""
from __future__ import annotations

import pytest
import torch

from dit_train.batch import cp_token_index
from dit_train.kernels import (MASKED, VarlenLayout, attention_mask, attention_with_lse, block_attention_with_lse,
                               merge_partials, sample_blocks, varlen_attention)
import dit_train.kernels.attention as attention_module


def _pack(seed: int, L: int, H: int = 3, D: int = 8):
    """Uneven samples (1..13 tokens) and trailing padding (-1), fp64 q/k/v."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < L - 5:
        n = min(int(torch.randint(1, 14, (1,), generator=g)), L - 3 - total)
        lens.append(n)
        total += n
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((L - total,), -1)])
    order = torch.cat([torch.arange(n) for n in lens] + [torch.arange(L - total)])
    q, k, v = (torch.randn(L, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    return seg, order, q, k, v, g


def _splits(L: int, layout: str, g: torch.Generator) -> list[torch.Tensor]:
    """Token sets of the ranks: a CP split of 2 or 3 ranks, or a random permutation cut in 3."""
    if layout == "random":
        return list(torch.randperm(L, generator=g).chunk(3))
    cp = int(layout[-1])
    return [cp_token_index(L, cp, r, layout[:-1]) for r in range(cp)]


LAYOUTS = ["contiguous2", "zigzag2", "zigzag3", "random"]


def _block_vs_dense(seg, order, q, k, v, iq, ik, causal, backend, g):
    """(errors of out/lse/dq/dk/dv, plan) of one query set against one key set."""
    mask = attention_mask(seg[iq], order[iq], seg[ik], order[ik], causal)
    seen = mask.any(dim=1)  # queries that see a key of this set
    w = torch.randn(int(iq.numel()), *q.shape[1:], generator=g, dtype=torch.float64)
    u = torch.randn(q.shape[1], int(iq.numel()), generator=g, dtype=torch.float64)
    results = []
    for which in ("dense", "blocks"):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q[iq], k[ik], v[ik]))
        if which == "dense":
            out, lse = attention_with_lse(qs, ks, vs, mask)
        else:
            plan = sample_blocks(seg[iq], order[iq], seg[ik], order[ik], causal)
            out, lse = block_attention_with_lse(qs, ks, vs, plan, backend)
        # rows that see nothing differ by convention (dense: mean of V; blocks: 0) and merge with weight 0
        loss = (out[seen] * w[seen]).sum() + (lse[:, seen] * u[:, seen]).sum()
        if seen.any():
            loss.backward()
        else:  # nothing to see: the ring skips such a step (the plan is empty)
            assert which == "dense" or plan.empty
            qs.grad, ks.grad, vs.grad = (torch.zeros_like(t) for t in (qs, ks, vs))
        results.append((out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad))
    (o1, l1, *g1), (o2, l2, *g2) = results
    assert (l2[:, ~seen] == MASKED).all() and (o2[~seen] == 0).all()
    diffs = {"out": (o1 - o2)[seen], "lse": (l1 - l2)[:, seen]}
    diffs.update({n: a - b for n, a, b in zip(("dq", "dk", "dv"), g1, g2)})
    return {n: float(d.abs().max()) if d.numel() else 0.0 for n, d in diffs.items()}, plan


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_equal_dense_reference_values_and_gradients(layout, causal, backend):
    """Every (query rank, key rank) pair, as a ring visits them: the blocks' out and lse equal the
    dense [Lq, Lk] reference on every query that sees a key, and so do the gradients of q, k, v
    (through out and lse), to fp64 rounding."""
    seg, order, q, k, v, g = _pack(3 + LAYOUTS.index(layout), 72)
    sets = _splits(72, layout, g)
    kinds = set()
    for iq in sets:
        for ik in sets:
            errs, plan = _block_vs_dense(seg, order, q, k, v, iq, ik, causal, backend, g)
            assert max(errs.values()) < 1e-12, (layout, causal, errs)
            kinds |= {gr.kind for gr in plan.groups}
            # only sample-diagonal blocks: never more scores than the samples' own pairs
            assert plan.score_elements() <= int(attention_mask(seg[iq], order[iq], seg[ik], order[ik], False).sum())
    if layout == "random" and causal:  # the staircases of a random permutation need masks
        assert "masked" in kinds
    if layout != "random":  # CP splits cut a sample into pieces wholly before / after each other
        assert "masked" not in kinds
    assert ("causal" in kinds) == causal


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_merged_blocks_equal_full_attention(causal):
    """Merging the blocks of every key rank (as the ring does) gives full attention, zigzag, fp64."""
    seg, order, q, k, v, g = _pack(11, 60)
    sets = _splits(60, "zigzag3", g)
    full = varlen_attention(q, k, v, VarlenLayout.build(seg, order, causal), "sdpa_dense")
    for iq in sets:
        parts = [block_attention_with_lse(q[iq], k[ik], v[ik], sample_blocks(seg[iq], order[iq], seg[ik], order[ik],
                                                                             causal)) for ik in sets]
        merged = merge_partials([o for o, _ in parts], [lse for _, lse in parts])
        torch.testing.assert_close(merged, full[iq], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_flex_blocks_forward(causal):
    """flex's document mask over the same blocks (forward only: no flex backward on the CPU)."""
    seg, order, q, k, v, g = _pack(5, 48)
    sets = _splits(48, "zigzag2", g)
    for iq in sets:
        for ik in sets:
            plan = sample_blocks(seg[iq], order[iq], seg[ik], order[ik], causal)
            ref = block_attention_with_lse(q[iq], k[ik], v[ik], plan, "math")
            got = block_attention_with_lse(q[iq], k[ik], v[ik], plan, "flex")
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_permuted_layout_uses_blocks_not_the_dense_mask(causal, monkeypatch):
    """A pack whose samples are not contiguous (zigzag order) runs the sdpa backend through the
    per-sample blocks: same values and gradients as the dense reference, and no dense call."""
    seg, order, q, k, v, g = _pack(13, 56)
    perm = torch.cat(_splits(56, "zigzag2", g))
    meta = VarlenLayout.build(seg[perm], order[perm], causal)
    assert meta.cu_seqlens is None
    dout = torch.randn_like(q)
    grads = {}
    for backend in ("sdpa_dense", "sdpa"):
        xs = [t[perm].clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*xs, meta, backend)
        out.backward(dout[perm])
        grads[backend] = [out.detach()] + [x.grad for x in xs]
        if backend == "sdpa_dense":
            monkeypatch.setitem(attention_module._IMPLS, "sdpa_dense", lambda *a: pytest.fail("dense mask used"))
    for a, b in zip(grads["sdpa"], grads["sdpa_dense"]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
