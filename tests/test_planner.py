"""Planner: ranking order, rejected layouts, and the memory model's monotonicity/calibration."""
from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch

from dit_train.models import model_config
from dit_train.perf.flops import train_flops
from dit_train.perf.memory import GIB, MemoryEstimate, RankSetup, calibrate_block, estimate_memory, model_shape
from dit_train.planning.planner import Candidate, Layout, Workload, apply_layout, check_layout, factorizations, plan
from dit_train.parallel.mesh import ParallelDims
from tests.conftest import CONF, compose_config


def layout(dp_replicate, dp_shard, cp_ulysses, cp_ring, mbt, ga, ac) -> Layout:
    return Layout(ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp_ulysses=cp_ulysses, cp_ring=cp_ring),
                  mbt, ga, ac)


def _cand(mbt, ac, ga, total_gib, cp=1, cap=10.0):
    mem = MemoryEstimate(0, 0, 0, 0, total_gib * GIB, 0, 0)
    return Candidate(layout(1, 2 // cp, cp, 1, mbt, ga, ac), mem, cap * GIB)


def test_rank_order_is_fits_micro_batch_no_checkpointing_accum_cp_headroom():
    c = {
        "too_big": _cand(8192, False, 1, 11.0),            # largest micro-batch but does not fit
        "mb4k_ac": _cand(4096, True, 1, 3.0),
        "mb4k_ga2": _cand(4096, False, 2, 6.0),
        "mb4k_ga1_tight": _cand(4096, False, 1, 9.0),
        "mb4k_ga1_roomy": _cand(4096, False, 1, 5.0),
        "mb2k": _cand(2048, False, 1, 1.0),
        "mb4k_cp2": _cand(4096, False, 1, 2.0, cp=2),      # 2048 per rank like mb2k, but CP
    }
    ranked = sorted(c.values(), key=Candidate.rank_key)
    names = {id(v): k for k, v in c.items()}
    assert [names[id(x)] for x in ranked] == [
        "mb4k_ga1_roomy", "mb4k_ga1_tight", "mb4k_ga2", "mb4k_ac", "mb2k", "mb4k_cp2", "too_big"]


def test_plan_prefers_checkpointing_only_when_needed(tiny_cfg):
    work = Workload(global_batch=8, max_sample_tokens=1024, mean_sample_tokens=1024)
    shape = model_shape(tiny_cfg.model)
    big, _ = plan(tiny_cfg, 2, 64 * GIB, work, backend="sdpa", shape=shape)
    best = big[0].layout
    assert big[0].fits and not best.activation_checkpointing and best.grad_accum == 1
    assert best.cp_ulysses * best.cp_ring == 1 and best.micro_batch_tokens == 4096  # 8·1024/2 per rank
    # a capacity between the AC-on and AC-off estimates of that layout: the same micro-batch with AC wins
    same = [c for c in big if c.layout.micro_batch_tokens == 4096 and c.layout.dp_shard == 2]
    on = next(c for c in same if c.layout.activation_checkpointing).memory.total
    off = next(c for c in same if not c.layout.activation_checkpointing).memory.total
    assert on < off
    mid, _ = plan(tiny_cfg, 2, (on + off) / 2, work, backend="sdpa", shape=shape)
    assert mid[0].fits and mid[0].layout.activation_checkpointing and mid[0].layout.micro_batch_tokens == 4096
    none, _ = plan(tiny_cfg, 2, 1.0, work, backend="sdpa", shape=shape)
    assert not any(c.fits for c in none)


def test_impossible_layouts_are_rejected_with_reasons(tiny_cfg):
    import copy

    cfg = copy.deepcopy(tiny_cfg)
    cfg.model.heads, cfg.model.dim = 3, 48  # 3 heads: Ulysses 2 cannot split them
    work = Workload(global_batch=1, max_sample_tokens=512, mean_sample_tokens=512)
    assert any("divisible by parallel.cp_ulysses=2" in r for r in check_layout(cfg, layout(1, 1, 2, 1, 512, 1, False), work))
    assert any("global_batch" in r for r in check_layout(cfg, layout(1, 2, 1, 1, 512, 1, False), work))
    assert any("longest sample" in r for r in check_layout(cfg, layout(1, 1, 1, 2, 256, 1, False), work))
    assert check_layout(cfg, layout(1, 1, 1, 2, 512, 1, False), work) == []
    cands, rejected = plan(cfg, 2, 64 * GIB, work, backend="sdpa")
    assert {(c.layout.cp_ulysses, c.layout.cp_ring, c.layout.dp) for c in cands} == {(1, 2, 1)}
    assert rejected and all(r for _, r in rejected)
    assert len(set(factorizations(4))) == len(factorizations(4)) == 10 and all(d.world == 4 for d in factorizations(4))


def test_memory_monotone_in_tokens_sharding_and_checkpointing():
    s = model_shape(model_config("dit", dim=256, depth=4, heads=4, patch_size=[1, 2, 2], in_channels=16))
    r = RankSetup(dp_shard=2, micro_batch_tokens=4096, checkpointing=False, precision="bf16", backend="flash")
    totals = [estimate_memory(s, replace(r, micro_batch_tokens=t)).total for t in (1024, 2048, 4096, 8192)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    state = [estimate_memory(s, replace(r, dp_shard=d)) for d in (2, 4, 8)]
    assert state[0].params > state[1].params > state[2].params and state[0].total > state[1].total > state[2].total
    ac = estimate_memory(s, replace(r, checkpointing=True))
    assert ac.activations < state[0].activations / 2  # depth 4: one block recomputed at a time
    cp = estimate_memory(s, replace(r, dp_shard=1, cp_ulysses=2))
    assert cp.activations < state[0].activations * 0.7  # CP halves the tokens each rank holds
    dense = estimate_memory(s, replace(r, backend="sdpa_dense"))
    assert dense.attention_workspace > 100 * state[0].attention_workspace  # O(L²) mask


@pytest.mark.parametrize("recompute", [True, False], ids=["prologues_on", "prologues_off"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_formula_matches_autograd_saved_tensors(precision, recompute):
    """Both settings of model.recompute_prologues (off keeps ~9·d + h more per DiT block), dense
    and with captions, an MLP width other than 4·d (separates the d and h terms)."""
    for cfg in (model_config("dit", dim=64, depth=2, heads=4, patch_size=[1, 2, 2], in_channels=16),
                model_config("dit", dim=64, depth=2, heads=4, mlp_ratio=2.5, patch_size=[1, 2, 2], in_channels=16,
                             text_dim=32),
                model_config("lm", dim=64, depth=2, heads=4, mlp_ratio=2.5)):
        r = calibrate_block(replace(cfg, recompute_prologues=recompute), tokens=192, precision=precision)
        assert abs(r["rel_error"]) < 0.03, (cfg.name, r)


def test_flops_count_quadratic_attention_per_sample():
    s = model_shape(model_config("dit", dim=64, depth=2, heads=4, patch_size=[1, 2, 2], in_channels=16))
    one, two = train_flops(s, [512]), train_flops(s, [256, 256])
    assert one - two == pytest.approx(3 * 4 * 64 * 2 * (512 ** 2 - 2 * 256 ** 2))
    assert two == pytest.approx(6 * s.params_per_token * 512 + 3 * 4 * 64 * 2 * 2 * 256 ** 2)


def test_plan_cli_smoke_runs_top_candidate(tiny_cfg, tmp_path, capsys):
    from dit_train.tools.plan import main

    out = tmp_path / "plan.json"
    args = ["model.dim=32", "model.depth=2", "data.num_clips=16", "data.max_frames=8", f"data.cache_dir={tiny_cfg.data.cache_dir}",
            "train.global_batch=4", "--world", "1", "--device", "cpu", "--gpu-mem-gib", "2", "--reserve-gib", "0", "--from-data",
            "--smoke", "1", "--smoke-steps", "3", "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    best = data["candidates"][0]
    assert best["fits"] and best["smoke"]["median_step_s"] > 0 and best["smoke"]["steps"] == 3
    assert "best (fastest of the 1 measured): parallel.dp_replicate=1" in capsys.readouterr().out


def test_a_config_every_layout_rejects_is_one_error(capsys):
    """A wrong config (here a text model under mode=video) is not a layout problem: one error
    line and exit code 2, not a table of every layout rejected for the same reason."""
    from dit_train.tools.plan import main

    assert main(["model=lm_tiny", "--world", "2", "--device", "cpu"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: mode=video cannot train model=lm") and "rejected" not in out.out
    assert main(["mode=llm", "model=lm_tiny", "--world", "2", "--device", "cpu"]) == 0


def test_plan_runs_as_module_from_any_directory(tmp_path):
    """`python -m dit_train.tools.plan` (the documented spelling) finds conf/ from anywhere."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dit_train.tools.plan", "model.dim=32", "model.depth=2", "--world", "2",
                        "--device", "cpu", "--gpu-mem-gib", "4", "--top", "3"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "best: parallel." in r.stdout and "dim=32" in r.stdout


@functools.cache
def _shape_of(overrides: tuple[str, ...]):
    """model_shape of a preset's composed model (built on the meta device once for this module:
    the registry test and the frames test both ask for the large presets)."""
    return model_shape(compose_config(list(overrides)).model)


def test_every_registered_model_plans_and_calibrates():
    """Each model in the registry (its conf/model/*.yaml presets) goes through the planner, and
    the memory model's activation coefficients of its small presets match autograd's saved
    tensors (a new model must declare them right). A tiny preset built on the meta device has no
    non-persistent buffer (engine/build.refuse_unfilled_buffers: nothing would fill it)."""
    from dit_train.engine.build import refuse_unfilled_buffers
    from dit_train.models import MODELS, build_model

    presets = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    seen = set()
    for preset in presets:
        mode = ["mode=llm"] if preset.startswith("lm") else []
        if preset.startswith("wan_i2v"):  # Wan 2.1 I2V: its conditioning and a latent cache (docs/wan.md)
            mode = ["cond.kind=first_frame", "cond.feed=concat", "data=latent_cache", "data.root=latents/"]
        if preset.startswith("wan_vace"):  # Wan VACE: its control video (docs/conditioning.md#wan-vace)
            mode = ["cond.control=true"]
        if preset in ("skyreels_v2_1_3b", "skyreels_v2_14b"):  # causal blocks of 5 latent frames: a latent cache
            mode = ["data=latent_cache", "data.root=latents/"]  # (the embedded clips' 8 frames are off that grid)
        cfg = compose_config([*mode, f"model={preset}"])
        seen.add(cfg.model.name)
        work = Workload(8, 4096, 2048)
        cands, _ = plan(cfg, 8, 80 * GIB, work, backend="flash", shape=_shape_of((*mode, f"model={preset}")))
        assert cands, preset
        if preset.endswith("tiny"):  # no buffer a meta build (parallel.meta_init) would leave unfilled
            with torch.device("meta"):
                refuse_unfilled_buffers(build_model(cfg.model))
        # calibrate_block feeds no image tokens yet, and its depth-1 model has no room for VACE's hint layers
        if preset.endswith("tiny") and not preset.startswith(("wan_i2v", "wan_vace")):
            for precision in ("fp32", "bf16"):
                r = calibrate_block(cfg.model, tokens=192, precision=precision)
                assert abs(r["rel_error"]) < 0.06, (preset, precision, r)
    assert seen == set(MODELS.names())
    table = torch.nn.Linear(2, 2)  # the refusal itself
    table.register_buffer("inv_freq", torch.ones(2), persistent=False)
    with pytest.raises(RuntimeError, match="inv_freq"):
        refuse_unfilled_buffers(torch.nn.Sequential(table))


def test_moe_models_plan_and_calibrate():
    """Mixture-of-experts blocks: the planner runs, each token counts k experts' matmuls, and the
    MoE activation term matches autograd's saved tensors (DiT and LM, fp32 and bf16)."""
    from dit_train.perf.memory import model_shape

    for mode, preset in (([], "dit_tiny"), (["mode=llm"], "lm_tiny")):
        moe = ["model.moe.num_experts=4", "model.moe.top_k=2"]
        cfg, dense = compose_config([*mode, f"model={preset}", *moe]), compose_config([*mode, f"model={preset}"])
        cands, _ = plan(cfg, 8, 80 * GIB, Workload(8, 4096, 2048), backend="flash")
        assert cands, preset
        s, d = model_shape(cfg.model), model_shape(dense.model)
        mlp = 2 * d.dim * d.hidden  # fc1 + fc2 weights of one dense block
        router = d.dim * 4
        assert s.params_per_token - d.params_per_token == d.depth * (mlp + router), preset  # 2 experts = 2 MLPs
        assert s.params - d.params > 3 * d.depth * mlp  # 4 experts' weights held
        for precision, recompute in (("fp32", True), ("bf16", True), ("fp32", False), ("bf16", False)):
            r = calibrate_block(replace(cfg.model, recompute_prologues=recompute), tokens=192, precision=precision)
            assert abs(r["rel_error"]) < 0.06, (preset, precision, recompute, r)


def test_planner_ranks_expert_parallel_degrees():
    """parallel.ep: the experts' state is split over ep ranks outside FSDP, every degree dividing
    the world and the experts is tried, and the expert traffic decides between them: big experts
    and few tokens per rank go expert-parallel, small experts and many tokens stay on FSDP."""

    cfg = compose_config(["model=dit_1b", "model.moe.num_experts=16", "model.moe.top_k=2", "train.precision=bf16",
                          "train.global_batch=16"])
    s = model_shape(cfg.model)
    assert s.params_experts == s.moe_blocks * 16 * (2 * s.dim * s.hidden + s.hidden + s.dim)
    r = RankSetup(dp_shard=8, micro_batch_tokens=8192, checkpointing="none", precision="bf16")
    fsdp, ep4 = estimate_memory(s, r), estimate_memory(s, replace(r, ep=4))
    dense = s.params - s.params_experts
    assert ep4.params == pytest.approx(4 * dense / 8 + 4 * s.params_experts / 4)
    assert ep4.optimizer == pytest.approx(8 * dense / 8 + 8 * s.params_experts / 4)
    assert ep4.fsdp_buffers < fsdp.fsdp_buffers  # the gathered blocks lose their experts
    assert ep4.extra["moe_dispatch"] > fsdp.extra["moe_dispatch"]

    def best(shape, tokens):
        cands, _ = plan(cfg, 8, 80 * GIB, Workload(16, tokens, tokens), backend="flash", shape=shape)
        assert {c.layout.ep for c in cands} == {1, 2, 4, 8}
        return cands[0].layout

    few_tokens = best(s, 2048)
    assert few_tokens.ep > 1 and f"parallel.ep={few_tokens.ep}" in few_tokens.overrides()
    small_experts = replace(s, params_experts=s.params_experts // 1000)  # same routing, tiny weights
    assert best(small_experts, 2048).ep == 1


def test_frames_question_for_every_registered_video_model():
    """plan --frames: every registered video model gets an answer per memory option; more
    memory-saving options fit longer clips; the asked clip's tokens follow the VAE and patch."""
    from dit_train.compose import compose
    from dit_train.models import MODELS
    from dit_train.planning.clips import clip_options, clip_tokens

    presets = {"dit": "dit_1b", "wan": "wan_14b", "ltx": "ltx_2b", "hunyuan15": "hunyuan15_8b", "wan_vace": "wan_vace_14b",
               "skyreels_v2": "skyreels_v2_14b",
               "ltx2": "ltx2_19b", "minimax_h3": "minimax_h3"}
    # latent tokens of an 81-frame 480x832 clip: Wan-VAE 4x8x8 at patch 1x2x2; LTX's VAE 8x32x32 at
    # patch 1; HunyuanVideo 1.5's VAE 4x16x16 at patch 1 (the same grid as Wan's)
    # MiniMax-H3's VAE 4x16x16 at patch 1x2x2 (21 latent frames by our 1 + 4k rule)
    tokens = {"ltx": 11 * 15 * 26, "ltx2": 11 * 15 * 26, "minimax_h3": 21 * 15 * 26}
    for name in MODELS.names():
        spec = MODELS[name]
        if spec.mode != "video":
            continue
        extra = {"wan_vace": ["cond.control=true"], "skyreels_v2": ["data=latent_cache", "data.root=latents/"]}.get(name, [])
        cfg = compose([f"model={presets[name]}", "train.precision=bf16", *extra])
        stride = spec.vae_stride
        assert clip_tokens(cfg.model, 81, 480, 832, stride) == tokens.get(name, 21 * 30 * 52), name
        # the registry test's shape of the same model (train.precision changes no model key); both
        # questions below ask for it
        shape = _shape_of((*extra, f"model={presets[name]}"))
        assert compose_config([*extra, f"model={presets[name]}"]).model == cfg.model, name
        res = {r.name: r for r in clip_options(cfg, 8, 80 * GIB, 81, 480, 832, shape=shape,
                                               reserve_bytes=2 * GIB, host_capacity=128 * GIB, max_frames=8001,
                                               vae_stride=stride)}
        assert len(res) == 12 and all(r.best is not None for r in res.values()), name
        assert res["ac=full"].longest_frames > res["ac=selective"].longest_frames > res["ac=none"].longest_frames, name
        assert res["ac=none+cpu_offload"].longest_frames >= res["ac=none"].longest_frames, name
        longest = res["ac=none"]
        assert longest.longest is not None and longest.longest.fits and longest.longest_frames < 8001
        # one latent frame more does not fit with any layout
        over = clip_options(cfg, 8, 80 * GIB, longest.longest_frames + stride[0], 480, 832, shape=shape,
                            reserve_bytes=2 * GIB, host_capacity=128 * GIB, max_frames=1, options=[("none", False, False)],
                            vae_stride=stride)
        assert over[0].best is None or not over[0].best.fits, name


def test_offload_moves_state_and_activations_to_the_host():
    s = model_shape(model_config("dit", dim=256, depth=4, heads=4, patch_size=[1, 2, 2], in_channels=16))
    r = RankSetup(dp_shard=2, micro_batch_tokens=8192, checkpointing="none", precision="bf16")
    plain = estimate_memory(s, r)
    cpu = estimate_memory(s, replace(r, cpu_offload=True))
    act = estimate_memory(s, replace(r, activation_offload=True))
    sel = estimate_memory(s, replace(r, checkpointing="selective"))
    every2 = estimate_memory(s, replace(r, checkpointing="selective", ac_every=2))
    assert cpu.params == cpu.grads == cpu.optimizer == 0 and cpu.host == plain.params + plain.grads + plain.optimizer
    assert act.activations < plain.activations and act.host == plain.activations
    assert plain.activations > every2.activations > sel.activations


def test_planner_recomputes_prologues_only_where_memory_is_short():
    """model.recompute_prologues as a planned option: off (faster) where both settings fit,
    on where only it fits; a model without prologues (Wan) plans without the key."""
    cfg = compose_config([])
    work = Workload(1, 4096, 4096)
    kw = dict(backend="sdpa", ac_options=("none",), max_micro_tokens=4096, prologue_options=(False, True))
    both, _ = plan(cfg, 1, 1e6 * GIB, work, **kw)
    total = {c.layout.recompute_prologues: c.memory.total for c in both}
    assert set(total) == {False, True} and total[False] > total[True]
    assert both[0].layout.recompute_prologues is False
    assert "model.recompute_prologues=false" in both[0].layout.overrides()
    short, _ = plan(cfg, 1, (total[False] + total[True]) / 2, work, **kw)
    assert short[0].fits and short[0].layout.recompute_prologues is True
    assert apply_layout(cfg, short[0].layout).model.recompute_prologues is True
    wan, _ = plan(compose_config(["model=wan_tiny"]), 1, 1e6 * GIB, work, **kw)
    assert {c.layout.recompute_prologues for c in wan} == {None}
    assert not any("recompute_prologues" in o for o in wan[0].layout.overrides())


def test_plan_cli_prologues_flag_narrows_the_planned_settings(tmp_path):
    """tools.plan --prologues: both (default) plans model.recompute_prologues off and on and
    takes on only where it holds what off cannot; on / off plan one; config leaves the key to
    the config. --frames answers plan it too."""
    from dit_train.tools.plan import main

    out = tmp_path / "p.json"
    base = ["model.dim=32", "model.depth=2", "--world", "1", "--device", "cpu", "--ac", "none", "--reserve-gib", "0",
            "--max-sample-tokens", "1024", "--max-micro-tokens", "1024", "--json", str(out)]

    def planned(*flags, mem=1000.0):
        main([*base, "--gpu-mem-gib", repr(mem), *flags])
        return json.loads(out.read_text())["candidates"]

    both = planned()
    lines = out.read_text().splitlines()  # compact: one line per candidate, not ~40
    assert len(lines) < 20 and sum('"layout"' in line for line in lines) == len(both)
    assert [c["layout"]["recompute_prologues"] for c in both] == [False, True]
    total = {c["layout"]["recompute_prologues"]: c["memory_GiB"]["total"] for c in both}
    assert total[False] > total[True]
    assert planned(mem=(total[False] + total[True]) / 2)[0]["layout"]["recompute_prologues"] is True
    assert {c["layout"]["recompute_prologues"] for c in planned("--prologues", "on")} == {True}
    assert {c["layout"]["recompute_prologues"] for c in planned("--prologues", "off")} == {False}
    config = planned("--prologues", "config")
    assert {c["layout"]["recompute_prologues"] for c in config} == {None}
    assert not any("recompute_prologues" in o for c in config for o in c["overrides"])

    frames = ["model.dim=32", "model.depth=2", "--world", "1", "--device", "cpu", "--reserve-gib", "0",
              "--frames", "9", "--height", "64", "--width", "64", "--max-frames", "17", "--json", str(out)]
    for flag, want in (("both", False), ("on", True)):
        main([*frames, "--gpu-mem-gib", "1000", "--prologues", flag])
        options = json.loads(out.read_text())["options"]
        assert {o["best"]["layout"]["recompute_prologues"] for o in options if o["best"]} == {want}


def test_memory_estimate_is_within_10pct_of_peaks_measured_on_a_gpu():
    """The planner's estimate of the layouts the GPU check trained (benchmarks/results/
    gpu_check_h200.json: a few real trainer steps of each on an H200, bf16, world 1) against
    torch.cuda.max_memory_allocated there. Before the autocast weight cache and backward's block
    recompute were counted as never coexisting, full activation checkpointing was 16-17 % over."""
    from pathlib import Path

    rows = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/gpu_check_h200.json").read_text())
    rows = rows["sections"]["planner"]["rows"]
    assert len(rows) == 3
    for row in rows:
        *overrides, ac = row["config"].split()
        cfg = compose_config(overrides)
        est = estimate_memory(model_shape(cfg.model), RankSetup(
            micro_batch_tokens=row["micro_tokens"], checkpointing=ac.removeprefix("ac="), precision=cfg.train.precision,
            optimizer=cfg.optim.name, backend=row["backend"], dp_mode=cfg.parallel.dp_mode))
        assert abs(est.total / GIB - row["peak_GiB"]) <= 0.10 * row["peak_GiB"], (row["config"], est.total / GIB)


def _ring_rank_saved_bytes(lens: list[int], R: int, dtype, backend: str, monkeypatch) -> int:
    """Bytes ring rank 0's attention saves for backward (`ContextParallelAttention._ring` as
    it runs, in one process: the K/V shift returns the next ring position's K/V)."""
    import torch

    import dit_train.parallel.context_parallel as cp_module
    from dit_train.batch import cp_token_index
    from dit_train.parallel.context_parallel import ContextParallelAttention, CPAttnLayout
    from dit_train.perf.memory import saved_activation_bytes

    L, H, D = sum(lens), 4, 32
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    order = torch.cat([torch.arange(n) for n in lens])
    index = [cp_token_index(L, R, r, "contiguous") for r in range(R)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, H, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    shifts = iter(range(1, R))
    # rank 0 receives from R-1, then R-2, ...: the K/V of ring position -step
    monkeypatch.setattr(cp_module, "_ring_shift", lambda kv, *a: torch.stack([k, v])[:, index[-next(shifts)]])
    attn = ContextParallelAttention(None, 1, 0, None, R, 0, backend)
    meta = CPAttnLayout(seg=seg, order=order, causal=False, index=index)
    saved, _ = saved_activation_bytes(lambda: attn(q[index[0]], k[index[0]], v[index[0]], meta), exclude=[q, k, v])
    return saved


MIXED = [40, 200, 7, 300, 120, 64, 64, 64, 150, 250, 90, 33, 300, 113, 117, 88]  # 2048 tokens


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[2048], [66] * 31 + [2], MIXED], ids=["one_clip", "32_clips", "mixed"])
def test_ring_memory_term_follows_the_block_kernel(lens, precision, monkeypatch):
    """`ring_block_bytes` (the planner's ring term) against what a ring rank's attention saves:
    one clip within 5%; short clips an upper bound within 40%; linear in the tokens, where the
    dense reference (sdpa_dense) keeps R·L_r² scores (within 15% of its term). Both terms count
    every ring step: a sample crosses the ranks' boundary, as in these packs (where none does,
    the step is skipped and the terms over-estimate)."""
    import torch

    from dit_train.perf.memory import ring_block_bytes

    s = model_shape(model_config("dit", dim=128, depth=1, heads=4, patch_size=[1, 2, 2], in_channels=16))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    L, R = sum(lens), 2
    measured = _ring_rank_saved_bytes(lens, R, dtype, "sdpa", monkeypatch)
    est = ring_block_bytes(s, L, 1, R, precision, "sdpa", max(lens))
    if len(lens) == 1:
        assert abs(est - measured) <= 0.05 * measured, (est, measured)
    else:
        assert measured <= est <= 1.4 * measured, (est, measured)
    dense = _ring_rank_saved_bytes(lens, R, dtype, "sdpa_dense", monkeypatch)
    dense_est = ring_block_bytes(s, L, 1, R, precision, "sdpa_dense", max(lens))
    assert abs(dense_est - dense) <= 0.15 * dense, (dense_est, dense)
    # the block kernel's term grows with the tokens, the dense one with their square
    assert ring_block_bytes(s, 4 * L, 1, R, precision, "sdpa", max(lens)) <= 4 * est
    assert ring_block_bytes(s, 4 * L, 1, R, precision, "sdpa_dense", max(lens)) == 16 * dense_est


def test_planner_gives_ring_the_memory_of_its_longest_sample(tiny_cfg):
    """The planner passes the workload's longest sample to the ring term: short clips make a
    ring layout's activations smaller than one clip filling the micro-batch does."""
    s = model_shape(model_config("dit", dim=256, depth=4, heads=4, patch_size=[1, 2, 2], in_channels=16))
    r = RankSetup(cp_ring=2, micro_batch_tokens=32768, checkpointing=False, precision="bf16", backend="flash")
    short, long = (estimate_memory(s, replace(r, sample_tokens=t)).activations for t in (1024, 32768))
    assert short < long
    assert estimate_memory(s, r).activations == long  # default: one sample fills the micro-batch
    dense = estimate_memory(s, replace(r, sample_tokens=32768, backend="sdpa_dense")).activations
    assert dense > 10 * long  # the reference's [L_r, L_r] scores
