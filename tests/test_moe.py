"""Mixture of experts: the layer, its fp32 router, the per-sample balance loss and the promise
(weights after k steps equal one process) with MoE on, for video and LLM layouts."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dit_train.engine.layout_equivalence import apply_layout, parse_layout, train_on_workers
from dit_train.loss.moe import local_expert_counts, router_token_losses
from dit_train.models.moe import MoEFeedForward
from tests.layout_cases import Case, assert_exact, run_cases

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=1.0", "model.moe.z_loss_coef=0.1"]


def _layer(seed: int = 0) -> MoEFeedForward:
    from dit_train.models.init import init_weights

    layer = MoEFeedForward(dim=8, hidden=16, num_experts=4, top_k=2)
    init_weights(layer, seed, "normal", std=0.3)
    return layer


def test_moe_layer_matches_a_token_by_token_loop():
    """Sorting (token, expert) rows by expert and running each expert once gives what each
    token computes on its own: Σ over its top-k experts of renormalised gate · expert(x)."""
    layer = _layer()
    x = torch.randn(23, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = layer(x)
    ex = layer.experts
    rows = []
    for t in range(x.shape[0]):
        p = F.softmax(layer.router(x[t]), dim=-1)
        top = p.topk(2).indices
        g = p[top] / p[top].sum()
        rows.append(sum(g[j] * F.linear(F.gelu(F.linear(x[t], ex.w1[e], ex.b1[e]), approximate="tanh"), ex.w2[e], ex.b2[e])
                        for j, e in enumerate(top.tolist())))
    ref = torch.stack(rows)
    # fp32 in another summation order (batched experts vs a loop): 1.4e-6 seen on an AVX2 CPU; a wrong
    # expert or routing weight is off by ~1e-1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert layer.routing.experts.shape == (23, 2)


def test_router_is_fp32_under_autocast():
    layer = _layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(10, 8))
    assert layer.routing.logits.dtype == torch.float32 and layer.routing.probs.dtype == torch.float32
    assert out.dtype == torch.bfloat16  # the experts themselves run in the compute dtype


def test_router_keeps_fp32_parameters_under_fsdp_bf16(tmp_path):
    """FSDP2 with bf16 parameters (the CUDA bf16 path, on a 1-rank gloo mesh): the router is its
    own unit with an fp32 policy, the experts compute in bf16."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dit_train.config import MoEConfig
    from dit_train.models import build_model, init_weights, model_config
    from dit_train.models.moe import moe_layers
    from dit_train.parallel.parallelize import fsdp_mp_policies, router_mp_policy
    from tests.test_kernels_perf import _tiny_pack

    cfg = model_config("dit", dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=4, init="normal",
                       moe=MoEConfig(num_experts=4, top_k=2))
    model = build_model(cfg)
    init_weights(model, seed=0, scheme="normal")
    seen = []
    for layer in moe_layers(model):
        layer.router.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
        layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(mod.w1.dtype))
    pos, seg, meta = _tiny_pack([8, 12])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        root_mp, block_mp = fsdp_mp_policies(torch.bfloat16)
        for layer in moe_layers(model):
            fully_shard(layer.router, mesh=mesh, mp_policy=router_mp_policy())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=block_mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp)
        out = model(torch.randn(seg.numel(), 16), pos, seg, torch.tensor([0.3, 0.7]), meta)
        out.float().square().mean().backward()
        logits = [layer.routing.logits.dtype for layer in moe_layers(model)]
    finally:
        dist.destroy_process_group()
    assert seen == [torch.float32, torch.bfloat16] * 2, seen
    assert logits == [torch.float32] * 2
    assert all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())


def _routing_pack(seed: int = 0):
    """Three samples of 5, 9 and 2 tokens plus 2 padding tokens, one MoE layer's routing."""
    layer = _layer(seed)
    seg = torch.tensor([0] * 5 + [1] * 9 + [2] * 2 + [-1] * 2)
    x = torch.randn(seg.numel(), 8, generator=torch.Generator().manual_seed(seed))
    layer(x)
    return layer.routing, seg


def test_balance_loss_is_the_per_sample_switch_loss_under_any_split():
    """Σ_t w_t·a_t with sample_mean weights equals the mean over samples of E·Σ_i f_i·P_i computed
    from each whole sample — also when the tokens are split over two "CP ranks" whose counts are
    summed (the sync), and with the same gradient with respect to the router probabilities."""
    routing, seg = _routing_pack()
    valid = seg >= 0
    T = torch.bincount(seg[valid], minlength=3)
    E, k = 4, 2
    # direct definition, per whole sample
    direct = 0.0
    for b in range(3):
        mask = seg == b
        f = torch.bincount(routing.experts[mask].reshape(-1), minlength=E).float() / (k * T[b])
        P = routing.probs[mask].mean(dim=0)
        direct = direct + E * (f * P).sum() / 3
    # per token, the sample's counts summed from two halves of the pack (as CP ranks would)
    halves = [torch.arange(0, 7), torch.arange(7, seg.numel())]
    whole = sum(local_expert_counts([_select(routing, h)], seg[h], valid[h], 3, E) for h in halves)
    assert torch.equal(whole, local_expert_counts([routing], seg, valid, 3, E))
    w = torch.where(valid, 1.0 / (3 * T[seg.clamp(min=0)].float()), 0.0)  # sample_mean: 1/(B·T_b)
    per_rank = [(router_token_losses([_select(routing, h)], whole, T, seg[h], k)[0] * w[h]).sum() for h in halves]
    total = sum(per_rank)
    torch.testing.assert_close(total, direct)
    g_direct = torch.autograd.grad(direct, routing.probs, retain_graph=True)[0]
    g_split = torch.autograd.grad(total, routing.probs)[0]
    torch.testing.assert_close(g_split, g_direct)
    # a perfectly balanced router scores 1
    even = type(routing)(routing.logits, torch.full_like(routing.probs, 0.25), routing.experts)
    a, _ = router_token_losses([even], whole, T, seg, k)
    assert abs(float((a * w).sum()) - 1.0) < 1e-6


def test_balance_loss_weights_its_counts_by_fractional_token_weights():
    """With soft-mask weights w_t (data.masks) the balance term of a sample is E·Σ_i f_i·P_i with
    f_i = Σ_t w_t·[t routed to i] / (k·T_b), P_i = Σ_t w_t·p_{t,i} / T_b, T_b = Σ_t w_t — also
    from two halves' integer counts summed (CP), and a weight-0 token routes nothing."""
    from dit_train.batch import WEIGHT_ONE

    routing, seg = _routing_pack(1)
    units = torch.randint(0, WEIGHT_ONE + 1, seg.shape, generator=torch.Generator().manual_seed(2)) * (seg >= 0)
    units[0] = 0  # a context token of sample 0
    w = units.double() / WEIGHT_ONE
    T = torch.stack([w[seg == b].sum() for b in range(3)])
    E, k = 4, 2
    direct = 0.0
    for b in range(3):
        m = seg == b
        routed = torch.zeros(E, dtype=torch.float64).index_add_(0, routing.experts[m].reshape(-1),
                                                                w[m].repeat_interleave(k))
        f = routed / (k * T[b])
        P = (w[m, None] * routing.probs[m].double()).sum(0) / T[b]
        direct = direct + E * (f * P).sum() / 3
    halves = [torch.arange(0, 7), torch.arange(7, seg.numel())]
    whole = sum(local_expert_counts([_select(routing, h)], seg[h], units[h], 3, E) for h in halves)
    assert torch.equal(whole, local_expert_counts([routing], seg, units, 3, E))
    a_w = torch.where(seg >= 0, w / (3 * T[seg.clamp(min=0)]), 0.0)  # sample_mean: w_t/(B·T_b)
    total = sum((router_token_losses([_select(routing, h)], whole, T, seg[h], k)[0].double() * a_w[h]).sum()
                for h in halves)
    torch.testing.assert_close(total, direct.to(total.dtype), rtol=1e-5, atol=1e-6)


def _select(routing, index):
    return type(routing)(routing.logits[index], routing.probs[index], routing.experts[index])


def test_moe_run_logs_router_metrics(tmp_path, tiny_cfg):
    from dit_train.compose import compose
    from dit_train.engine.worker import train

    cfg = apply_layout(tiny_cfg, {})
    cfg.model.moe = compose([*MOE]).model.moe
    cfg.train.steps, cfg.run_dir, cfg.train.save_weights = 2, str(tmp_path), False
    train(cfg)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        assert 0.5 < r["moe/aux_loss"] < 4.0 and r["moe/z_loss"] > 0
        assert 0 < r["moe/load_min"] <= 0.25 <= r["moe/load_max"] < 1


# --- the promise with MoE on -------------------------------------------------------------------

MOE_LAYOUTS = [
    "dp_shard=2,cp_ulysses=2,grad_accum=2",   # FSDP2 × Ulysses × accumulation: counts summed within CP
    "cp_ring=2,micro_batch_tokens=300",       # ring attention; samples split across ranks
    "dp_replicate=2,dp_shard=2",              # HSDP
    "dp_shard=2,dp_mode=ddp,grad_accum=3",    # DDP, three micro-batches per rank
]
REDUCTIONS = ["sample_mean", "token_mean"]


@pytest.fixture(scope="module")
def moe_cfg(tiny_cfg):
    from dit_train.compose import compose

    cfg = apply_layout(tiny_cfg, {})
    cfg.model.moe = compose([*MOE]).model.moe
    cfg.model.moe.every = 2  # block 1 of 2 has experts, block 0 stays dense
    return cfg


@pytest.fixture(scope="module")
def moe_layouts(moe_cfg):
    """{(layout, reduction): (one-process result, layout result)}, one launch per world size."""
    return run_cases({(spec, r): Case(moe_cfg, spec, r) for spec in MOE_LAYOUTS for r in REDUCTIONS})


@pytest.mark.slow
@pytest.mark.parametrize("spec", MOE_LAYOUTS)
def test_moe_layout_matches_one_process(spec, moe_layouts):
    for reduction in REDUCTIONS:
        oracle, got = moe_layouts[(spec, reduction)]
        assert any(".experts.w1" in k for k in oracle), "no MoE layer in the model"
        assert_exact(oracle, got, f"{spec} {reduction}")


@pytest.mark.slow
def test_balance_loss_moves_the_router(moe_cfg, moe_layouts):
    """The oracle's router weights depend on aux_loss_coef (else the layout test above could not
    notice a wrongly weighted balance term)."""
    cfg = apply_layout(moe_cfg, {}, "sample_mean")
    cfg.model.moe.aux_loss_coef = cfg.model.moe.z_loss_coef = 0.0
    (without,) = train_on_workers([cfg])
    ref = moe_layouts[(MOE_LAYOUTS[0], "sample_mean")][0]  # the one-process run
    name = next(k for k in ref if k.endswith("mlp.router.weight") and not k.startswith("__"))
    moved = (ref[name] - without[name]).abs().max() / (ref[name] - ref[f"__init__/{name}"]).abs().max()
    assert moved > 1e-2, f"the router barely feels the balance loss ({float(moved):.2e})"


@pytest.mark.slow
def test_llm_moe_layout_matches_one_process():
    """Causal LM with experts, zigzag CP over a ring (documents split across ranks) and FSDP."""
    from tests.test_llm import LLM_TINY

    from dit_train.compose import compose

    cfg = compose([*LLM_TINY, *MOE, "model.moe.every=1"])
    ref, other = run_cases({"llm": Case(cfg, "dp_shard=2,cp_ring=2,grad_accum=2", "token_mean")})["llm"]
    assert any(".experts.w1" in k for k in ref)
    assert_exact(ref, other, "LLM MoE")


def test_aux_coefficient_means_the_same_on_every_layout(tiny_cfg, capsys):
    """tools.bench_moe_aux: our balance-loss gradient is the same for one process, grad_accum,
    DP and a smaller micro-batch budget; the per-micro-batch recipe's is not."""
    from dit_train.tools.bench_moe_aux import main

    from tests.conftest import TINY

    assert main(["--layouts", "1;grad_accum=3;dp=2,grad_accum=2;micro_batch_tokens=300", *TINY, *MOE,
                 f"data.cache_dir={tiny_cfg.data.cache_dir}"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4
    for cells in rows[1:]:
        ours_ratio, ours_diff, micro_ratio, micro_diff = (float(c) for c in cells[1:5])
        assert abs(ours_ratio - 1) < 1e-5 and ours_diff < 1e-5, cells
        assert micro_diff > 1e-2, cells  # the usual recipe's pull on the router changes with the layout


# --- expert parallelism ----------------------------------------------------------------------

EP_LAYOUTS = [
    "ep=2,dp_shard=4",                                   # 2 EP groups: expert grads summed over replicas
    "ep=4,dp_shard=2,cp_ulysses=2,grad_accum=2",         # experts over FSDP × Ulysses ranks
    "ep=2,dp_replicate=2,dp_shard=2,cp_fsdp_mode=none",  # HSDP, CP-less; expert sum apart from FSDP
    "ep=2,dp_shard=2,cp_ring=2,meta_init=true",          # meta-device build, ring CP
    "ep=4,dp_shard=4,dp_mode=ddp,grad_accum=2",          # DDP ignores the experts
    "ep=2,dp_shard=4,dp_mode=none",                      # no wrapper: manual sums
]


def _full_ac(cfg) -> None:
    cfg.model.activation_checkpointing = "full"  # dispatch collectives re-run in the recompute


@pytest.fixture(scope="module")
def ep_results(moe_cfg):
    from dataclasses import replace

    cfg = apply_layout(moe_cfg, {}, "sample_mean")
    # one block, with experts: the dispatch, the expert replica sums and the shards need no second
    # (the runs are Python-bound; dense-beside-MoE blocks are moe_layouts' case)
    cfg.model.depth = 1
    cfg.model.moe = replace(cfg.model.moe, every=1)
    cases = {spec: Case(cfg, spec) for spec in EP_LAYOUTS}
    cases["ep=2,dp_shard=4 + full AC"] = Case(cfg, "ep=2,dp_shard=4", change=_full_ac)
    return run_cases(cases)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [*EP_LAYOUTS, "ep=2,dp_shard=4 + full AC"])
def test_expert_parallel_layout_matches_one_process(spec, ep_results):
    assert_exact(*ep_results[spec], spec)


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_on_another_ep(tmp_path, data_cache):
    """Saved with ep=2 over 4 ranks, resumed with ep=4 and on one process: the weights (all
    experts, gathered into weights.safetensors) equal an uninterrupted one-process run."""
    from tests.conftest import train_in_process
    from tests.test_checkpoint import _max_diff
    from tests.conftest import TINY

    base = [*TINY, *MOE, "model.depth=1", "train.steps=4", f"data.cache_dir={data_cache}"]  # one block of experts
    ref, a = tmp_path / "ref", tmp_path / "a"
    train_in_process(base, ref)
    # the saving run stops at its checkpoint (step 1 of the 4): the steps after it would not be read
    train_in_process([*base, "parallel.dp_shard=4", "parallel.ep=2", "train.ckpt_every=2", "train.steps=2"], a)
    ck = a / "checkpoints" / "step_00000001"
    w_ref = load_file(ref / "weights.safetensors")
    assert w_ref["blocks.0.mlp.experts.w1"].shape[0] == 4
    for name, layout in (("ep4", ["parallel.dp_shard=4", "parallel.ep=4"]), ("one", [])):
        train_in_process([*base, *layout, f"train.resume={ck}"], tmp_path / name)
        w = load_file(tmp_path / name / "weights.safetensors")
        assert _max_diff(w_ref, w) < 1e-6, (layout, _max_diff(w_ref, w))


@pytest.mark.slow
def test_expert_parallel_collectives_per_step(moe_cfg):
    """Gradient collectives stay once per step with EP on (the expert replica sum included);
    the dispatch's all-to-alls run per micro-batch and MoE layer: counts, rows out and back,
    and the two in backward."""
    from dit_train.engine.launch import launch_local
    from dit_train.tools.bench_collectives import count_step_collectives

    cfg = apply_layout(moe_cfg, parse_layout("ep=2,dp_shard=4"))
    counts = launch_local(count_step_collectives, (cfg, [1, 3]), 4, cfg.launcher)[0]
    one, three = counts[1], counts[3]
    assert three["micro_batches"] > one["micro_batches"]
    for name in ("reduce_scatter_tensor", "all_reduce"):
        assert one[name] == three[name], (name, counts)
    for c in (one, three):
        layers = 1  # moe_cfg: experts in every second block of 2
        assert c["all_to_all_single"] == layers * c["micro_batches"], c
        assert c["ep_all_to_all"] == 4 * layers * c["micro_batches"], c


def _dispatch_against_local(idle: bool) -> float:
    """On 2 ranks with ep=2: expert outputs, input and expert-weight gradients through the
    all-to-all dispatch vs the same rows through all 4 experts in-process. idle: every row
    chooses expert 0 or 1, so rank 1 receives no row and must still join both backward
    all-to-alls. Returns the largest difference."""
    import torch.distributed as dist

    from dit_train.config import ParallelConfig
    from dit_train.parallel.expert_parallel import apply_expert_parallel
    from dit_train.parallel.mesh import init_parallel

    # a short collective timeout: a rank left out of the backward fails here instead of hanging
    ctx = init_parallel(ParallelConfig(dp_shard=2, ep=2, dp_mode="none", device="cpu", timeout_s=60))
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    rows = 3 + 4 * ctx.rank  # uneven on purpose
    choice = torch.randint(0, 2 if idle else 4, (rows,), generator=gen)
    x, w = torch.randn(rows, 8, generator=gen), torch.randn(rows, 8, generator=gen)
    results = []
    for ep in (False, True):
        layer = _layer()
        if ep:
            apply_expert_parallel(torch.nn.ModuleDict({"mlp": layer}), ctx)
        xi = x.clone().requires_grad_()
        y = layer.dispatch(layer.experts, xi, choice, 4)
        params = list(layer.experts.parameters())
        g = torch.autograd.grad((y * w).sum(), [xi, *params])
        expert_grads = [t.to_local() if hasattr(t, "to_local") else t for t in g[1:]]
        if not ep:  # all ranks' tokens, this rank's two experts
            for t in expert_grads:
                dist.all_reduce(t)
            expert_grads = [t[2 * ctx.rank:2 * ctx.rank + 2] for t in expert_grads]
        results.append([y.detach(), g[0], *expert_grads])
    # rows in bf16 with fp32 experts, as under FSDP2's bf16 policy (experts are not FSDP's)
    layer = _layer()
    apply_expert_parallel(torch.nn.ModuleDict({"mlp": layer}), ctx)
    y16 = layer.dispatch(layer.experts, x.bfloat16(), choice, 4)
    assert y16.dtype == torch.bfloat16 and float((y16.float() - results[0][0]).abs().max()) < 0.1
    return max(float((a - b).abs().max()) for a, b in zip(*results))


@pytest.mark.parametrize("idle", [False, True], ids=["busy", "one_rank_idle"])
def test_expert_parallel_dispatch_matches_local_experts(idle):
    from dit_train.config import LauncherConfig
    from dit_train.engine.launch import launch_local

    for rank, diff in launch_local(_dispatch_against_local, (idle,), 2, LauncherConfig()).items():
        assert diff < 1e-6, (rank, diff)
