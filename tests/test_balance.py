"""train.balance=cost: the step plan balances ranks by modelled time (data_pipelines/packing.py,
dit_train/perf/cost.py) and changes only where samples go. Pure functions, no workers: the
layout-exactness of balance=cost is in tests/test_layouts.py."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hydra.errors import ConfigCompositionException

from dit_train.data_pipelines.packing import (
    StepCost,
    balanced_split,
    cost_split,
    lockstep_time,
    pack_ffd,
    place,
    plan_step,
    rank_times,
)
from dit_train.perf.cost import SPEEDS, recompute_factor, step_cost
from dit_train.perf.flops import attention_flops, train_flops
from dit_train.perf.memory import model_shape
from dit_train.tools.bench_balance import main as bench_balance
from tests.conftest import compose_config

# attention-heavy: a 2048-token sample costs ~3x its tokens' worth next to 128-token ones
COST = StepCost(per_token=1.0, per_sq_token=1 / 1024, per_sample=4.0, per_micro=16.0)


def mixed_lengths(n: int = 400, seed: int = 0) -> dict[int, int]:
    """Images, short and long clips: lengths 64..2048, heavy-tailed."""
    rng = np.random.default_rng(seed)
    return {i: int(x) for i, x in enumerate(rng.choice([64, 128, 144, 256, 512, 1024, 1536, 2048], size=n,
                                                       p=[.2, .15, .15, .15, .12, .1, .08, .05]))}


@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("dp,ga,budget", [(1, 1, 4096), (2, 1, 2048), (2, 3, 2500), (8, 2, 4096), (3, 1, 3000)])
def test_cost_plan_moves_samples_never_changes_them(dp, ga, budget, lockstep):
    lengths = mixed_lengths()
    model = replace(COST, lockstep=lockstep)
    time = lockstep_time if lockstep else (lambda plan, lengths, c: max(rank_times(plan, lengths, c)))
    for step in range(6):
        tok = plan_step(step, lengths, 24, dp, ga, budget, seed=1)
        cost = plan_step(step, lengths, 24, dp, ga, budget, seed=1, cost=model)
        assert cost.sample_ids == tok.sample_ids
        got = sorted(i for rank in cost.micro_batches for mb in rank for i in mb)
        assert got == sorted(tok.sample_ids)  # each sample exactly once
        # every rank as many micro-batches as the token plan gives, each within the budget
        assert {len(rank) for rank in cost.micro_batches} == {tok.num_micro}
        assert all(sum(lengths[i] for i in mb) <= budget for rank in cost.micro_batches for mb in rank)
        # never modelled slower than the token plan (it is kept when the cost plan is not faster)
        assert time(cost.micro_batches, lengths, model) <= time(tok.micro_batches, lengths, model)


def test_cost_balance_evens_out_what_token_balance_does_not():
    """Mean over steps of max/mean modelled rank time at DP 8, 8 samples a rank: token balancing
    leaves > 5% (ranks wait for the one with the long clips), cost balancing < 1%."""
    lengths = mixed_lengths()
    ratios = {"tokens": [], "cost": []}
    for step in range(10):
        for name, out in ratios.items():
            plan = plan_step(step, lengths, 64, 8, 1, 4096, seed=0, cost=COST if name == "cost" else None)
            t = rank_times(plan.micro_batches, lengths, COST)
            out.append(max(t) / np.mean(t))
    assert np.mean(ratios["tokens"]) > 1.05 and np.mean(ratios["cost"]) < 1.01, ratios


def test_cost_split_improves_on_longest_first():
    """LPT puts 3 | 3 then 2, 2, 2 onto the lighter side: 7 vs 5; a swap reaches 6 | 6."""
    w = {0: 3.0, 1: 3.0, 2: 2.0, 3: 2.0, 4: 2.0}
    groups = cost_split(list(w), w, 2)
    assert sorted(sum(w[i] for i in g) for g in groups) == [6.0, 6.0]
    assert groups == cost_split(list(reversed(w)), w, 2)  # deterministic whatever the input order


def test_token_plan_unchanged_without_cost():
    """balance=tokens is the plan as it was: tokens split over ranks, then over groups, then
    first-fit-decreasing, every rank padded to the same count."""
    lengths = mixed_lengths(50)
    ids = list(range(20))
    want = []
    for rank_ids in balanced_split(ids, lengths, 3):
        want.append([mb for g in balanced_split(rank_ids, lengths, 2) for mb in pack_ffd(g, lengths, 2048)])
    m = max(len(r) for r in want)
    want = [r + [[]] * (m - len(r)) for r in want]
    assert place(ids, lengths, 3, 2, 2048) == want


def test_step_cost_follows_the_flop_model():
    shape = model_shape(compose_config(["model.dim=64", "model.depth=2"]).model)
    speed = SPEEDS["cpu"]
    c = step_cost(shape, speed)
    t = 1000
    flops_lin = train_flops(shape, [t]) - attention_flops(shape, [t])
    assert c.sample(t) == pytest.approx(speed.sample_s + flops_lin / speed.linear_flops
                                        + attention_flops(shape, [t]) / speed.attention_flops)
    cp = step_cost(shape, speed, cp=4)
    assert cp.per_token == pytest.approx(c.per_token / 4) and cp.per_sq_token == pytest.approx(c.per_sq_token / 4)
    causal = step_cost(shape, speed, causal=True)
    assert causal.per_sq_token == pytest.approx(c.per_sq_token / 2) and causal.per_token == pytest.approx(c.per_token)
    full = step_cost(shape, speed, checkpointing="full")
    assert full.per_token == pytest.approx(c.per_token * 4 / 3)
    assert recompute_factor(4, "full", every=2) == pytest.approx(1 + 1 / 6)
    assert recompute_factor(4, "selective") == 1.0


@pytest.mark.slow
def test_bench_balance_quick(data_cache, tmp_path):
    """tools.bench_balance runs end to end (modelled rows, the measured DP-2 run) and writes its JSON."""
    out = tmp_path / "b.json"
    assert bench_balance(["--quick", "--cache-dir", data_cache, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {(r["distribution"], r["dp"]) for r in data["modelled"]} == {
        (d, dp) for d in ("wan_buckets", "wan_mixed", "embedded") for dp in (2, 8)}
    for r in data["modelled"]:  # cost never models slower, and no placement beats the bound
        assert r["speedup"] >= 1 and r["speedup lockstep"] >= 1 and r["cost max/mean"] >= r["bound"] - 1e-9
    assert [r["balance"] for r in data["measured"]] == ["tokens", "cost"]
    assert all(r["step CPU s"] > 0 and r["dp_mode"] == "ddp" for r in data["measured"])


def test_balance_is_a_checked_choice():
    assert compose_config(["train.balance=cost"]).train.balance == "cost"
    with pytest.raises(ConfigCompositionException, match="train.balance"):
        compose_config(["train.balance=time"])
