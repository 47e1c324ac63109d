"""Conditioned video training (issue 32): context tokens weigh 0 and stay out of T_b, and the
result is the one-process result on every layout — also where a CP rank holds only context."""
from __future__ import annotations

import pytest
import torch

from dit_train.batch import WEIGHT_ONE, PackedBatch
from dit_train.engine.layout_equivalence import apply_layout, parse_layout
from tests.conftest import TINY, compose_config
from tests.layout_cases import Case, assert_exact, run_cases

# every kind with every feed, on our DiT and on pixel-space Wan, each on a layout mixing DP, CP
# (Ulysses / ring) and accumulation; cond.prob 0.5 mixes conditioned and plain samples
CASES = {
    "first_frame-timestep-dit": (["cond.kind=first_frame", "cond.feed=timestep"], "cp_ulysses=2,cp_ring=2,grad_accum=2"),
    "first_frame-concat-wan": (["cond.kind=first_frame", "cond.feed=concat", "cond.prob=0.5", "model=wan_tiny"],
                               "dp_shard=2,cp_ulysses=2"),
    "first_last-timestep-wan": (["cond.kind=first_last", "cond.feed=timestep", "model=wan_tiny"],
                                "dp_shard=2,cp_ring=2,grad_accum=2"),
    "first_last-concat-dit": (["cond.kind=first_last", "cond.feed=concat"], "dp_replicate=2,cp_ring=2"),
    # a 4-patch clip alone in its pack: CP rank 0 holds its two context patches and nothing else
    "prefix-timestep-dit": (["cond.kind=prefix", "cond.prefix_frames=4", "cond.feed=timestep"], "dp_shard=2,cp_ring=2"),
    "prefix-concat-wan": (["cond.kind=prefix", "cond.prefix_frames=4", "cond.feed=concat", "cond.prob=0.5",
                           "model=wan_tiny"], "dp_shard=2,dp_mode=ddp,grad_accum=2"),
}


# diffusers' Wan 2.1 I2V layout (4 mask channels, cached condition latents, CLIP tokens per clip) on
# the tiny I2V latent cache (tests/conftest.py): 5 clips of uneven sizes, half of them conditioned
I2V_CASE = ("first_frame-wan21_i2v", "dp_shard=2,cp_ulysses=2")
# the same run with LoRA (rank 4, Wan's default targets): the adapters, the base frozen
I2V_LORA_CASE = ("first_frame-wan21_i2v-lora", "dp_shard=2,cp_ulysses=2")
# masks and control videos off a latent cache (--masks --control, tests/conftest.py): fractional
# token weights from the cached mask sums, control latents appended, the first frame given
CACHE_CASE = ("masks-control-first_frame-latent_cache", "dp_shard=2,cp_ring=2")
# Wan VACE on the same cache (its control latents and inactive latents as the 72-channel VACE
# context, hints after blocks 0 and 1): the VACE blocks' attention split by CP like Wan's
VACE_CASE = ("control-wan_vace-latent_cache", "dp_shard=2,cp_ulysses=2")


def i2v_cfg(i2v_cache, lora_rank: int = 0):
    from tests.conftest import CLIP_DIM, TEXT_DIM, TINY_MODEL, Z_DIM

    cfg = compose_config([*TINY_MODEL, "model=wan_i2v_tiny", "model.heads=2", "model.patch_size=[1,2,2]", "data=latent_cache",
                          f"data.root={i2v_cache}", f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}",
                          f"model.image_dim={CLIP_DIM}", "cond.kind=first_frame", "cond.feed=concat", "cond.prob=0.5",
                          "train.global_batch=4", "train.micro_batch_tokens=0", "loss.reduction=sample_mean",
                          f"model.lora.rank={lora_rank}", f"model.lora.alpha={2 * lora_rank}"])
    cfg.optim.max_grad_norm = 0.05
    return cfg


def cache_companions_cfg(companion_cache):
    from tests.conftest import TEXT_DIM, TINY_MODEL, Z_DIM

    cfg = compose_config([*TINY_MODEL, "model=wan_tiny", "model.heads=2", "model.patch_size=[1,2,2]", "data=latent_cache",
                          f"data.root={companion_cache}", f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}",
                          "data.masks=true", "cond.control=true", "cond.kind=first_frame", "train.global_batch=4",
                          "train.micro_batch_tokens=0", "loss.reduction=sample_mean"])
    cfg.optim.max_grad_norm = 0.05
    return cfg


def vace_cfg(companion_cache):
    from tests.test_wan_vace import vace_cache_cfg

    return vace_cache_cfg(companion_cache, ["train.global_batch=4", "train.micro_batch_tokens=0", "model.depth=3"])


def cond_cfg(data_cache: str, overrides: list[str], reduction: str = "sample_mean"):
    cfg = compose_config([*overrides, *TINY, "model.text_len=16", f"loss.reduction={reduction}"], cache_dir=data_cache)
    cfg.optim.max_grad_norm = 0.05  # always clips: the global norm must be exact too
    return cfg


def context_only_shards(cfg) -> int:
    """(step, DP rank, micro-batch, CP rank) shards of cfg's run that hold tokens of samples but
    only context tokens (weight 0) of samples whose T_b > 0 — rebuilt the way the trainer cuts them."""
    from dit_train.tasks import build_task
    from dit_train.data_pipelines.packing import plan_step
    from dit_train.parallel.context_parallel import split_for_cp
    from dit_train.parallel.mesh import ParallelDims

    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
    dims, t = ParallelDims.from_config(cfg.parallel), cfg.train
    found = 0
    for step in range(t.steps):
        plan = plan_step(step, task.lengths(), t.global_batch, dims.dp, t.grad_accum, t.micro_batch_tokens, t.seed)
        for packs in plan.micro_batches:
            for ids in packs:
                full = task.build(ids, step)
                whole = full.local_weights()
                for c in range(dims.cp):
                    local, _ = split_for_cp(full, dims.cp, c, "contiguous")
                    mine = local.seg >= 0
                    held = local.seg[mine].unique()
                    found += bool(mine.any() and int(local.weight_units()[mine].sum()) == 0 and (whole[held] > 0).all())
    return found


SPECS = {name: spec for name, (_, spec) in CASES.items()} | dict([I2V_CASE, I2V_LORA_CASE, CACHE_CASE, VACE_CASE])


@pytest.fixture(scope="module")
def layouts(data_cache, tiny_cfg, i2v_cache, companion_cache):
    """{case: (one-process result, layout result)}, every layout in one launch of 4 workers."""
    cfgs = {name: cond_cfg(data_cache, overrides) for name, (overrides, _) in CASES.items()}
    cfgs[I2V_CASE[0]] = i2v_cfg(i2v_cache)
    cfgs[I2V_LORA_CASE[0]] = i2v_cfg(i2v_cache, lora_rank=4)
    cfgs[CACHE_CASE[0]] = cache_companions_cfg(companion_cache)
    for cfg in cfgs.values():  # one block: the runs are Python-bound (a step costs its blocks' calls, not
        cfg.model.depth = 1  # their width); what CP, DP and accumulation split needs no second block
    cfgs[VACE_CASE[0]] = vace_cfg(companion_cache)  # VACE's hints after blocks 0 and 1: its 3 blocks stay
    return run_cases({name: Case(cfgs[name], spec) for name, spec in SPECS.items()})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SPECS))
def test_conditioned_training_matches_one_process(case, layouts):
    oracle, got = layouts[case]
    if case == I2V_LORA_CASE[0]:  # adapters moved (the comparison is not vacuous), the frozen base did not
        adapters = [k for k in oracle if ".lora_" in k and not k.startswith("__")]
        assert adapters and any(not torch.equal(oracle[k], oracle[f"__init__/{k}"]) for k in adapters)
        assert all(torch.equal(oracle[k], oracle[f"__init__/{k}"]) for k in oracle
                   if not k.startswith("__") and ".lora_" not in k)
    assert_exact(oracle, got, f"{case} on {SPECS[case]}")


def test_a_cp_rank_holds_only_context_in_the_prefix_case(data_cache, tiny_cfg):
    """The layout of the prefix case really gives a CP rank nothing but context tokens of a
    sample that has supervised tokens elsewhere (its T_b share is 0; it still syncs)."""
    overrides, spec = CASES["prefix-timestep-dit"]
    cfg = apply_layout(cond_cfg(data_cache, overrides), parse_layout(spec))
    assert context_only_shards(cfg) > 0


def _pack_with_context(data_cache, overrides):
    from dit_train.tasks import build_task

    cfg = cond_cfg(data_cache, overrides)
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
    frames = [task.dataset[i].pixels.shape[1] for i in range(len(task.lengths()))]
    ids = [i for i, f in enumerate(frames) if f // 2 >= 3][:3]  # clips of 3+ temporal patches
    return cfg, task, ids, task.build(ids, 0)


def test_context_tokens_weigh_zero_and_stay_out_of_T_b(data_cache, tiny_cfg):
    """first_frame, timestep feed: the first temporal patch of every clip is given clean (x = x0,
    timestep 0) with weight 0, and T_b counts the generated tokens only."""
    from dit_train.loss import sync_counts

    cfg, task, ids, pack = _pack_with_context(data_cache, ["cond.kind=first_frame"])
    counts = sync_counts([pack], None, None)
    for k, sid in enumerate(ids):
        x0 = task.dataset[sid].pixels
        per_patch = (x0.shape[2] // 8) * (x0.shape[3] // 8)
        mine = pack.seg == k
        first = mine & (pack.pos[:, 0] == 0)
        assert int(first.sum()) == per_patch and bool(pack.tokens["clean"][first].all())
        assert int(pack.weight_units()[first].abs().sum()) == 0 and not pack.valid[first].any()
        assert float(counts.sample_tokens[0][k]) == int(mine.sum()) - per_patch  # context not in T_b
        from dit_train.tasks.video import patchify

        torch.testing.assert_close(pack.tokens["x"][first], patchify(x0, (2, 8, 8))[0][:per_patch], rtol=0, atol=0)
    assert counts.num_samples == len(ids)


def test_counting_context_in_T_b_changes_the_weights(data_cache, tiny_cfg, capsys):
    """The mistake the contract avoids: the same one-process run with context tokens counted in
    T_b (each sample's tokens then weigh 1/(B·T_b) with a T_b too large by its context) ends on
    other weights — measured by tools.context_shift, which docs/conditioning.md quotes; the tool
    refuses a config without context tokens in one line."""
    from dit_train.tools.context_shift import context_shift, main

    cfg = cond_cfg(data_cache, CASES["first_frame-timestep-dit"][0])
    cfg.optim.max_grad_norm = 0.0  # clipping would renormalise the shifted gradient and hide part of it
    cfg.train.steps = 1
    assert context_shift(cfg) > 0.05
    assert main(["--steps", "1", "cond.kind=first_frame", "cond.feed=concat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cond.kind=first_frame cond.feed=concat has no context tokens") and err.count("\n") == 1


# -- fractional weights: exact sums at the metadata sync ------------------------------------------

def fractional_pack() -> PackedBatch:
    """Three samples (112 tokens) with weights from 8-bit masks (token means, k/255 units);
    sample 0's first 56 tokens are context (weight 0): the first CP rank (of 2 or 4) holds
    nothing else."""
    from dit_train.data_pipelines.companions import mask_weight_units

    g = torch.Generator().manual_seed(3)
    patch = (1, 2, 2)
    parts, seg = [], []
    for k, (f, h, w) in enumerate([(4, 8, 8), (3, 6, 4), (5, 4, 6)]):
        mask = torch.randint(0, 256, (f, h, w), generator=g, dtype=torch.uint8)
        units = mask_weight_units(mask, patch)
        if k == 0:
            units[:56] = 0
        parts.append(units)
        seg.append(torch.full((units.numel(),), k))
    seg_t = torch.cat(seg)
    pack = PackedBatch(seg=seg_t, pos=torch.zeros(seg_t.numel(), 3, dtype=torch.long), order=torch.zeros_like(seg_t),
                       valid=torch.ones_like(seg_t, dtype=torch.bool), sample_ids=torch.arange(3))
    return pack.with_weight(torch.cat(parts))


def _fractional_worker(parallel):
    """This rank's T_b, N, B and token weights of the CP-split fractional pack."""
    from dit_train.loss import sync_counts, token_weights
    from dit_train.parallel.context_parallel import split_for_cp
    from dit_train.parallel.mesh import init_parallel

    ctx = init_parallel(parallel)
    local, meta = split_for_cp(fractional_pack(), ctx.dims.cp, ctx.cp_rank, "contiguous")
    counts = sync_counts([local], ctx.cp_group, ctx.dp_group, world=ctx.dims.world)
    weights = {r: token_weights(r, local.seg, local.loss_weight(), counts, 0) for r in ("sample_mean", "token_mean")}
    return {"T": counts.sample_tokens[0], "N": counts.num_tokens, "B": counts.num_samples, "index": meta.index[ctx.cp_rank],
            "weights": weights, "share": local.local_weights()}


@pytest.mark.parametrize("layout", ["cp_ring=2", "cp_ulysses=2,cp_ring=2"])
def test_fractional_weights_sync_exactly_on_every_cp_split(layout, tiny_cfg):
    """T_b = Σ w of each sample summed over the CP group is the same number, bit for bit, as on
    one process, and so is every token's weight — for 8-bit mask weights, where float sums in
    another order would not be (shown below), and with a rank holding only context."""
    from dit_train.engine.launch import launch_local
    from dit_train.loss import sync_counts, token_weights

    full = fractional_pack()
    one = sync_counts([full], None, None)
    assert isinstance(one.num_tokens, float) and one.num_samples == 3
    units = torch.stack([full.weight_units()[full.seg == k].sum() for k in range(3)])
    assert torch.equal(one.sample_tokens[0], units.double() / WEIGHT_ONE)  # T_b = Σ w, not a token count
    parallel = apply_layout(tiny_cfg, parse_layout(layout)).parallel
    world = parallel.cp_ring * parallel.cp_ulysses
    results = launch_local(_fractional_worker, (parallel,), world, tiny_cfg.launcher)
    assert int(results[0]["share"][0]) == 0 and float(one.sample_tokens[0][0]) > 0  # rank 0: context of sample 0 only
    for r in results.values():
        assert torch.equal(r["T"], one.sample_tokens[0]) and r["N"] == one.num_tokens and r["B"] == one.num_samples
        for reduction, w in r["weights"].items():
            want = token_weights(reduction, full.seg, full.loss_weight(), one, 0)
            keep = r["index"] < full.num_tokens
            assert torch.equal(w[keep], want[r["index"][keep]]), reduction
    # why integers: the same fp32 weights summed in another order (the ranks' halves, then
    # added) give another T_b; the int64 units cannot
    w32 = full.loss_weight()
    n = full.num_tokens // 2
    split = torch.zeros(3).index_add_(0, full.seg[:n], w32[:n]) + torch.zeros(3).index_add_(0, full.seg[n:], w32[n:])
    in_order = torch.stack([w32[full.seg == k].cumsum(0)[-1] for k in range(3)])
    assert not torch.equal(split, in_order)


def test_mask_weights_are_exact_units_of_8_bit_values():
    from dit_train.data_pipelines.companions import mask_weight_units

    full = torch.full((2, 4, 4), 255, dtype=torch.uint8)
    assert torch.equal(mask_weight_units(full, (1, 2, 2)), torch.full((8,), WEIGHT_ONE))
    k = torch.full((2, 4, 4), 51, dtype=torch.uint8)  # 51/255 = 0.2 exactly 257·51 units
    assert torch.equal(mask_weight_units(k, (2, 2, 2)), torch.full((4,), 257 * 51))


# -- per-token timesteps in the models ----------------------------------------------------------

@pytest.mark.parametrize("model", ["dit", "wan"])
def test_clean_tokens_read_their_sample_at_timestep_zero(model, data_cache, tiny_cfg):
    """A pack whose every token is clean gives the output of the same pack at t = 0 (per-token
    rows are the per-sample rows at t = 0), and other t only where tokens are not clean."""
    from dit_train.engine.build import build_parallel_model
    from dit_train.kernels import VarlenLayout
    from dit_train.parallel.mesh import init_parallel
    from dit_train.batch import model_context

    cfg = cond_cfg(data_cache, ["cond.kind=first_frame"] + (["model=wan_tiny"] if model == "wan" else []))
    _, task, _, pack = _pack_with_context(data_cache, ["cond.kind=first_frame"]
                                          + (["model=wan_tiny"] if model == "wan" else []))
    net = build_parallel_model(cfg, init_parallel(cfg.parallel)).eval()
    attn = VarlenLayout.build(pack.seg, pack.order, False)
    ctx = {k: v for k, v in model_context(pack).items() if k != "clean"}
    t = pack.samples["t"]
    with torch.no_grad():
        at_zero = net(pack.tokens["x"], pack.pos, pack.seg, torch.zeros_like(t), attn, **ctx)
        all_clean = net(pack.tokens["x"], pack.pos, pack.seg, t, attn, **ctx, clean=torch.ones_like(pack.seg, dtype=torch.bool))
        mixed = net(pack.tokens["x"], pack.pos, pack.seg, t, attn, **ctx, clean=pack.tokens["clean"])
        plain = net(pack.tokens["x"], pack.pos, pack.seg, t, attn, **ctx)
    torch.testing.assert_close(all_clean, at_zero, rtol=1e-5, atol=1e-6)
    clean = pack.tokens["clean"]
    assert (mixed[clean] - plain[clean]).abs().max() > 1e-4  # the context tokens did read t = 0


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    (["cond.kind=prefix", "cond.prefix_frames=8"], "nothing would be left to generate; raise data.max_frames"),
    (["cond.kind=prefix", "cond.prefix_frames=3"], "cond.prefix_frames=3 must be a multiple of model.patch_size[0]=2"),
    (["mode=llm", "cond.kind=first_frame"], "mode=llm has none: set cond.kind=none"),
    (["model.cond_channels=4"], "model.cond_channels=4 is derived from cond"),
    (["cond.kind=first_frame", "cond.prob=1.5"], "cond.prob=1.5 must be in [0, 1]"),
])
def test_bad_conditioning_is_refused_before_the_run(overrides, needle):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        check_config(compose_config(overrides))


def test_input_width_follows_the_feed():
    """model.cond_channels is derived: concat adds the clip's channels and a mask, for Wan too."""
    assert compose_config(["cond.kind=first_frame", "cond.feed=concat"]).model.cond_channels == 4
    wan = compose_config(["model=wan_tiny", "cond.kind=first_frame", "cond.feed=concat"])
    from dit_train.models.wan import wan_config

    assert (wan_config(wan.model)["in_channels"], wan_config(wan.model)["out_channels"]) == (7, 3)
    assert compose_config(["cond.kind=first_frame"]).model.cond_channels == 0


def test_a_clip_too_short_for_its_conditioning_trains_unconditioned_and_is_counted(data_cache, tiny_cfg, caplog):
    from dit_train.tasks import build_task

    cfg = cond_cfg(data_cache, ["cond.kind=first_last"])
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
    short = [i for i in range(len(task.lengths())) if task.dataset[i].pixels.shape[1] // 2 <= 2][:1]
    assert short, "the tiny set should have a clip of 2 temporal patches"
    pack = task.build(short, 0)
    assert bool(pack.valid.all()) and not pack.tokens["clean"].any() and task.conditioner.short == set(short)
    assert "too short for cond.kind=first_last" in caplog.text


def test_a_text_to_video_wan_checkpoint_widens_into_concat_conditioning(tmp_path):
    """model.pretrained from a T2V folder with cond.feed=concat: the patch embedding gets the
    mask and frame channels with zero weights, so the widened model starts as the T2V model."""
    from dit_train.kernels import VarlenLayout
    from dit_train.models import build_model, model_config
    from dit_train.models.init import load_full_weights
    from dit_train.models.diffusers_family import read_pretrained, to_diffusers

    base = dict(dim=32, heads=2, depth=1, ffn_dim=64, freq_dim=32, text_dim=32, text_len=6, in_channels=3,
                patch_size=[1, 2, 2], init="normal")
    t2v_cfg = model_config("wan", **base)
    t2v = build_model(t2v_cfg)
    torch.manual_seed(0)
    for p in t2v.parameters():
        torch.nn.init.normal_(p, std=0.2)
    to_diffusers(t2v.state_dict(), t2v_cfg).save_pretrained(str(tmp_path / "wan"))
    i2v_cfg = model_config("wan", **base, cond_channels=4)
    state = read_pretrained(str(tmp_path / "wan"), i2v_cfg)
    w = state["patch_embedding.weight"]
    assert w.shape[1] == 7 and float(w[:, 3:].abs().sum()) == 0
    i2v = build_model(i2v_cfg)
    load_full_weights(i2v, state)
    x = torch.randn(8, 3 * 4)
    seg, pos = torch.zeros(8, dtype=torch.long), torch.stack([torch.zeros(8), torch.arange(8) // 4, torch.arange(8) % 4], 1).long()
    meta = VarlenLayout.build(seg, torch.arange(8), False)
    cond = torch.randn(8, 4 * 4)
    with torch.no_grad():
        torch.testing.assert_close(i2v(torch.cat([x, cond], 1), pos, seg, torch.tensor([0.3]), meta),
                                   t2v(x, pos, seg, torch.tensor([0.3]), meta), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="in_channels=3"):  # a width that is neither is still refused
        read_pretrained(str(tmp_path / "wan"), model_config("wan", **(base | {"in_channels": 4})))
