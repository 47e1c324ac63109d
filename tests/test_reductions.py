"""Reductions are pure weight functions; their sums reproduce the textbook losses."""
from __future__ import annotations

import pytest
import torch

from dit_train.batch import PackedBatch
from dit_train.loss import StepCounts, sync_counts, token_weights


def _batch(lens, valid_frac=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]) if lens else torch.zeros(0, dtype=torch.long)
    valid = torch.rand(seg.numel(), generator=g) < valid_frac
    b = PackedBatch(seg=seg, pos=torch.zeros(seg.numel(), 1, dtype=torch.long), order=torch.zeros_like(seg), valid=valid,
                    sample_ids=torch.arange(len(lens)))
    return b.pad_to_multiple(4)


def _total(reduction, batches, losses):
    meta = sync_counts(batches, None, None)
    return sum(float((token_weights(reduction, b.seg, b.valid, meta, k) * l).sum()) for k, (b, l) in enumerate(zip(batches, losses)))


def test_reductions_match_their_definitions():
    batches = [_batch([3, 10, 1], 0.8, 0), _batch([7], 0.8, 1), _batch([2, 2], 0.8, 2)]
    g = torch.Generator().manual_seed(5)
    losses = [torch.rand(b.num_tokens, generator=g) for b in batches]
    per_sample = []
    for b, l in zip(batches, losses):
        for s in range(b.num_samples):
            m = (b.seg == s) & b.valid
            if m.any():
                per_sample.append(l[m])
    all_tokens = torch.cat(per_sample)
    assert _total("token_mean", batches, losses) == pytest.approx(float(all_tokens.mean()), rel=1e-6)
    assert _total("sample_mean", batches, losses) == pytest.approx(float(torch.stack([x.mean() for x in per_sample]).mean()), rel=1e-6)
    assert _total("sample_sum", batches, losses) == pytest.approx(float(torch.stack([x.sum() for x in per_sample]).mean()), rel=1e-6)
    assert _total("sum", batches, losses) == pytest.approx(float(all_tokens.sum()), rel=1e-6)
    naive = torch.stack([l[b.valid].mean() for b, l in zip(batches, losses)]).mean()
    assert _total("naive_mean", batches, losses) == pytest.approx(float(naive), rel=1e-6)


@pytest.mark.parametrize("reduction", ["sample_mean", "token_mean", "sample_sum", "sum", "naive_mean"])
def test_no_valid_tokens_gives_zero_weights_not_nan(reduction):
    batches = [_batch([4, 3], valid_frac=0.0), _batch([])]
    meta = sync_counts(batches, None, None)
    assert meta.num_tokens == 0 and meta.num_samples == 0
    for k, b in enumerate(batches):
        w = token_weights(reduction, b.seg, b.valid, meta, k)
        assert torch.isfinite(w).all() and float(w.abs().sum()) == 0.0


def test_padding_gets_zero_weight():
    b = _batch([5, 2])
    meta = sync_counts([b], None, None)
    for r in ["sample_mean", "token_mean", "sample_sum", "sum", "naive_mean"]:
        w = token_weights(r, b.seg, b.valid, meta, 0)
        assert float(w[b.seg < 0].abs().sum()) == 0.0


def test_samples_without_valid_tokens_do_not_count():
    b = _batch([3, 4])
    b.valid[b.seg == 1] = False
    meta = sync_counts([b], None, None)
    assert meta.num_samples == 1 and meta.sample_tokens[0].tolist() == [3, 0]


def test_unknown_reduction_is_rejected():
    b = _batch([2])
    with pytest.raises(ValueError, match="loss.reduction"):
        token_weights("mean", b.seg, b.valid, StepCounts([torch.tensor([2])], 1, 2, [2], 1), 0)
