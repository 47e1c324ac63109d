"""Batch-size warm-up: the global batch of step s is a function of s only (never of the layout),
so the promise (weights equal one process) and exact resume hold during the ramp too."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from dit_train.data_pipelines.packing import batch_size_at, plan_step, step_samples
from dit_train.engine.layout_equivalence import apply_layout, parse_layout, relative_difference, train_on_workers

WARMUP = {"batch_warmup_steps": 3, "batch_warmup_start": 1}  # global batch 6: steps take 1, 2, 4, then 6


def _old_step_samples(step: int, n: int, batch: int, seed: int) -> list[int]:
    """The sample order before warm-up existed (runs without it must keep their samples)."""
    spe = n // batch
    epoch, k = divmod(step, spe)
    perm = np.random.default_rng([seed, epoch, 0x5A17]).permutation(n)
    return [int(i) for i in perm[k * batch:(k + 1) * batch]]


def test_batch_ramps_and_steps_never_repeat_a_sample():
    assert [batch_size_at(s, 8, 10) for s in range(12)] == [1, 1, 2, 3, 3, 4, 5, 5, 6, 7, 8, 8]
    assert [batch_size_at(s, 6, 3, 1) for s in range(5)] == [1, 2, 4, 6, 6]
    for s in range(60):
        ids = step_samples(s, 23, 8, 5, warmup_steps=10)
        assert len(ids) == batch_size_at(s, 8, 10) and len(set(ids)) == len(ids)
    # after the ramp the stream runs epoch by epoch: each epoch's steps use distinct samples
    for n, batch in ((48, 8), (50, 8), (16, 6)):
        assert all(step_samples(s, n, batch, 3) == _old_step_samples(s, n, batch, 3) for s in range(100))


def test_warmup_positions_match_walking_the_stream():
    """The closed form after the ramp equals consuming the stream step by step."""
    n, batch, warm, seed = 37, 8, 7, 2
    epoch, offset = 0, 0
    for s in range(80):
        b = batch_size_at(s, batch, warm)
        if offset + b > n:
            epoch, offset = epoch + 1, 0
        perm = np.random.default_rng([seed, epoch, 0x5A17]).permutation(n)
        assert step_samples(s, n, batch, seed, warm) == [int(i) for i in perm[offset:offset + b]], s
        offset += b


def test_small_warmup_steps_plan_on_any_layout():
    """1 sample over 4 ranks × 2 accumulation groups: empty packs fill in, every rank the same count."""
    lengths = list(range(10, 40))
    for dp, accum in ((1, 1), (4, 2), (2, 3)):
        plan = plan_step(0, lengths, 8, dp, accum, 100, 0, warmup_steps=5, warmup_start=1)
        assert sorted(i for rank in plan.micro_batches for mb in rank for i in mb) == plan.sample_ids
        assert len(plan.sample_ids) == 1 and len({len(r) for r in plan.micro_batches}) == 1


@pytest.fixture(scope="module")
def warm_cfg(tiny_cfg):
    cfg = apply_layout(tiny_cfg, {})
    cfg.train.steps = 4
    cfg.train.batch_warmup_steps, cfg.train.batch_warmup_start = WARMUP["batch_warmup_steps"], WARMUP["batch_warmup_start"]
    return cfg


@pytest.mark.slow
def test_warmup_layouts_match_one_process(warm_cfg):
    specs = ["1", "dp_shard=2,cp_ulysses=2,grad_accum=2", "dp_replicate=2,dp_shard=2"]
    results = train_on_workers([apply_layout(warm_cfg, parse_layout(s), "sample_mean") for s in specs])
    for spec, got in zip(specs[1:], results[1:]):
        rel = relative_difference(results[0], got)
        assert rel <= 1e-4, f"{spec}: weights differ by {rel:.2e} of the update during the batch warm-up"


def test_resume_in_the_middle_of_the_warmup_is_exact(tmp_path, warm_cfg):
    """Checkpoint after step 1 of a 3-step ramp, resume: the same weights as the straight run,
    and metrics.jsonl's `samples` shows the ramp 1, 2, 4, 6."""
    from dit_train.engine.worker import train

    full, part = apply_layout(warm_cfg, {}), apply_layout(warm_cfg, {})
    full.run_dir, full.train.ckpt_every, full.train.keep_last = str(tmp_path / "full"), 2, 5
    train(full)
    recs = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in recs] == [1, 2, 4, 6]
    part.run_dir, part.train.resume = str(tmp_path / "part"), str(tmp_path / "full" / "checkpoints" / "step_00000001")
    train(part)
    a, b = load_file(tmp_path / "full" / "weights.safetensors"), load_file(tmp_path / "part" / "weights.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    recs = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in recs] == [4, 6]
