"""Diffusion forcing (loss.frame_noise=block, docs/causal.md): every causal block of a clip at its own
t, drawn from the clip's own generator; clean history blocks weigh nothing and stay out of T_b;
the DiT conditions each token on its block's t. Also the clip-length rules of block-causal
training (tasks/causal.py): a fixed length off the block grid is refused, variable lengths are
trimmed to whole blocks and counted. The layouts' exactness: tests/test_layouts.py."""
from __future__ import annotations

import pytest
import torch

from dit_train.batch import WEIGHT_ONE
from dit_train.config.errors import ConfigError
from dit_train.engine.checks import check_config
from dit_train.engine.layout_equivalence import apply_layout, relative_difference
from dit_train.kernels import VarlenLayout
from dit_train.models.dit import DiTConfig, build
from dit_train.tasks import build_task
from dit_train.tasks.causal import kept_frames
from dit_train.tasks.video import pack_clips, token_times
from tests.conftest import TINY, compose_config
from tests.layout_cases import TOL, Case, assert_exact, run_cases

DF = ["model.causal_block_frames=4", "loss.frame_noise=block"]


@pytest.fixture(scope="module")
def df_cfg(tiny_cfg):
    cfg = apply_layout(tiny_cfg, {})
    cfg.model.causal_block_frames = 4
    cfg.loss.frame_noise = "block"
    return cfg


def _task(cfg, **loss):
    cfg = apply_layout(cfg, {})
    for k, v in loss.items():
        setattr(cfg.loss, k, v)
    return build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)


def test_block_t_is_constant_inside_a_block_and_differs_across_blocks(df_cfg):
    """Each token's t is its block's: one value per (clip, block), different blocks of a clip at
    different t (independent draws), and the noisy input of every block is (1 − t_j)·x0 + t_j·ε."""
    task = _task(df_cfg)
    ids = list(range(df_cfg.data.num_clips))
    pack = task.build(ids, 3)
    t = token_times(pack)
    two_blocks = 0
    for s in range(pack.num_samples):
        per_block = [t[(pack.seg == s) & (pack.block == j)] for j in pack.block[pack.seg == s].unique()]
        assert all(bool((v == v[0]).all()) for v in per_block)
        firsts = [float(v[0]) for v in per_block]
        assert firsts == pack.samples["block_t"][s, : len(firsts)].tolist()
        if len(firsts) > 1:
            two_blocks += 1
            assert len(set(firsts)) == len(firsts), firsts
    assert two_blocks >= 5
    # x_t = x0 + t·(ε − x0) = x0 + t·target per token, with the token's block t
    x0 = pack.tokens["x"] - t[:, None] * pack.tokens["target"]
    clip = _task(df_cfg, frame_noise="clip").build(ids, 3)
    assert torch.allclose(x0, clip.tokens["x"] - clip.samples["t"][clip.seg][:, None] * clip.tokens["target"], atol=1e-5)
    # layout-independent: the same clip alone in a pack, or at another place, draws the same t
    alone = task.build([ids[5]], 3)
    assert torch.equal(alone.samples["block_t"][0, :2], pack.samples["block_t"][5, :2])


def test_nondecreasing_schedule_sorts_block_t(df_cfg):
    """block_noise_schedule=nondecreasing: t never falls along a clip's blocks; same draws sorted."""
    ind = _task(df_cfg).build(list(range(16)), 1)
    inc = _task(df_cfg, block_noise_schedule="nondecreasing").build(list(range(16)), 1)
    for s in range(16):
        n = int(inc.block[inc.seg == s].max()) + 1
        row, raw = inc.samples["block_t"][s, :n], ind.samples["block_t"][s, :n]
        assert bool((row[1:] >= row[:-1]).all()) and torch.equal(row, raw.sort().values)


def test_history_blocks_are_clean_and_outside_t_b(df_cfg):
    """history_prob=1: every clip of 2+ blocks has its first block(s) clean (x = x0, t = 0) and
    weightless, so the metadata's T_b (local_weights) counts the supervised tokens only, and their
    targets never reach the loss; a clip of one block stays supervised."""
    task = _task(df_cfg, history_prob=1.0)
    pack = task.build(list(range(16)), 2)
    clean = _task(df_cfg, frame_noise="clip").build(list(range(16)), 2)
    t = token_times(pack)
    T_b = pack.local_weights()
    with_history = 0
    for s in range(16):
        m = pack.seg == s
        blocks = int(pack.block[m].max()) + 1
        hist = m & (t == 0)
        if blocks == 1:
            assert not hist.any()
        else:
            with_history += 1
            assert hist.any() and not bool((m & ~hist & (t == 0)).any())
            x0 = clean.tokens["x"] - clean.samples["t"][clean.seg][:, None] * clean.tokens["target"]
            assert torch.allclose(pack.tokens["x"][hist], x0[hist], atol=1e-6)
        assert bool((pack.weight[hist] == 0).all()) and bool((pack.weight[m & ~hist] == WEIGHT_ONE).all())
        assert int(T_b[s]) == int((m & ~hist).sum()) * WEIGHT_ONE
    assert with_history >= 5


def test_block_forward_equals_clip_forward_at_one_t():
    """The DiT's per-block route (t [S, B] + block) with every block of a clip at the clip's t gives
    the per-clip route's output (fp64), and another block t moves that block's tokens."""
    torch.manual_seed(0)
    cfg = DiTConfig(dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=3, init="normal",
                    causal_block_frames=2, text_dim=8, pooled_text=True)
    model = build(cfg).double()
    for p in model.parameters():  # adaLN-zero would hide the conditioning
        torch.nn.init.normal_(p, std=0.1)
    clips = [torch.randn(3, F, 4, 4, dtype=torch.float64) for F in (5, 3)]
    b = pack_clips({"x": clips}, (1, 2, 2), 12, {}, torch.arange(2), causal_block=2).pad_to_multiple(7)
    meta = VarlenLayout.build(b.seg, b.mask_order, b.causal)
    ctx = dict(context=torch.randn(2, 4, 8, dtype=torch.float64), context_len=torch.tensor([4, 2]))
    t = torch.tensor([0.3, 0.7], dtype=torch.float64)
    x = b.tokens["x"].double()
    per_clip = model(x, b.pos, b.seg, t, meta, **ctx)
    per_block = model(x, b.pos, b.seg, t[:, None].expand(2, 3).contiguous(), meta, block=b.block, **ctx)
    torch.testing.assert_close(per_block, per_clip, rtol=1e-12, atol=1e-12)
    other = t[:, None].repeat(1, 3)
    other[0, 2] = 0.9  # clip 0's last block
    moved = (model(x, b.pos, b.seg, other, meta, block=b.block, **ctx) - per_clip).abs().amax(1) > 1e-9
    assert torch.equal(moved, (b.seg == 0) & (b.block == 2))


def test_lengths_follow_the_trim(df_cfg):
    """Variable-length clips train with whole blocks: the task's lengths (the step plan's) are the
    packs' token counts, a 6-frame clip keeps 4 frames, and clips shorter than a block are whole."""
    task = _task(df_cfg)
    frames = [task.dataset.frames(i) for i in range(16)]
    assert 6 in frames
    pack = task.build(list(range(16)), 0)
    assert torch.bincount(pack.seg, minlength=16).tolist() == task.lengths()
    assert [kept_frames(f, 4) for f in (2, 4, 6, 8, 11)] == [2, 4, 4, 8, 8]


def _error(overrides):
    cfg = compose_config(TINY + overrides)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert len(err.value.args[0].splitlines()) == 1, err.value.args[0]
    return err.value.args[0]


def test_bad_causal_configs_refused():
    """One error line before the run: a fixed clip length off the block grid (data.max_frames,
    data.frames of one length), per-block noise without blocks or with cond, history without
    per-block noise; the line names what to change."""
    assert "data.max_frames=4 or 8" in _error(["model.causal_block_frames=4", "data.max_frames=6"])
    assert "data.frames=[4, 4] or [8, 8]" in _error(["model.causal_block_frames=4", "data.frames=[6,6]",
                                                      "data.max_frames=16"])
    assert "model.causal_block_frames" in _error(["loss.frame_noise=block"])
    assert "cond.kind=none" in _error(DF + ["cond=first_frame"])
    assert "loss.frame_noise=block" in _error(["model.causal_block_frames=4", "loss.history_prob=0.5"])
    assert "[0, 1]" in _error(DF + ["loss.history_prob=1.5"])
    check_config(compose_config(TINY + DF + ["loss.history_prob=0.5", "loss.block_noise_schedule=nondecreasing"]))
    check_config(compose_config(TINY + ["model.causal_block_frames=4"]))  # variable lengths: trimmed, not refused


# The layouts: the one-process oracle vs DP × ring, Ulysses and Ulysses × ring on the uneven
# embedded clips (1 or 2 blocks of K = 4 frames), per-block t sorted along time, half the clips
# of 2 blocks with a clean history block (weight 0: their T_b, summed over the CP group by the
# metadata sync, counts the supervised block only) and CosMap weighting read per token.
DF_LAYOUTS = ["dp_shard=2,cp_ring=2", "cp_ulysses=2", "cp_ulysses=2,cp_ring=2"]


@pytest.fixture(scope="module")
def df_layouts(df_cfg):
    cfg = apply_layout(df_cfg, {})
    # one block: the runs are Python-bound (a step costs its blocks' calls, not their width), and the
    # causal blocks split over CP, the counts and the shards need no second transformer block
    cfg.model.depth = 1
    cfg.optim.max_grad_norm = 0.05  # always clips: the global norm across shards must be exact
    cfg.train.ema_decay = 0.9
    cfg.model.pooled_text = True
    cfg.loss.history_prob = 0.5
    cfg.loss.block_noise_schedule = "nondecreasing"
    cfg.loss.weighting = "cosmap"
    clip = apply_layout(cfg, {})
    clip.loss.frame_noise, clip.loss.history_prob, clip.loss.block_noise_schedule = "clip", 0.0, "independent"
    cases = {(spec, r): Case(cfg, spec, r) for spec in DF_LAYOUTS for r in ("sample_mean", "token_mean")}
    cases[("clip", "sample_mean")] = Case(clip, "cp_ulysses=2", "sample_mean")  # its oracle: not vacuous
    return run_cases(cases)


@pytest.mark.slow
@pytest.mark.parametrize("spec", DF_LAYOUTS)
def test_diffusion_forcing_layout_matches_one_process(spec, df_layouts):
    # measured (two blocks): the layouts agree to 2.4e-6 of the update, per-block vs per-clip noise
    # differ by 0.26; every block's t drawn with the rank in the seed: 0.23 to 0.33
    per_block = df_layouts[(DF_LAYOUTS[0], "sample_mean")][0]
    per_clip = df_layouts[("clip", "sample_mean")][0]
    assert relative_difference(per_block, per_clip) > TOL, "per-block noise should train differently"
    for reduction in ("sample_mean", "token_mean"):
        oracle, got = df_layouts[(spec, reduction)]
        assert_exact(oracle, got, f"{spec} {reduction} diffusion forcing")


def test_history_under_sigma_sqrt_stays_finite(df_cfg):
    """loss.weighting=sigma_sqrt is 1/t², infinite on history tokens (t = 0): they weigh 0 in the
    reduction, so their loss must be finite (0·inf would be nan) and the weighted sum finite."""
    task = _task(df_cfg, history_prob=1.0, weighting="sigma_sqrt")
    pack = task.build(list(range(6)), 0)
    assert bool((token_times(pack) == 0).any())
    from dit_train.models import build_model
    model = build_model(df_cfg.model)
    loss = task.per_token_loss(model, pack, VarlenLayout.build(pack.seg, pack.mask_order, pack.causal))
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite((loss * pack.loss_weight()).sum()))


def test_shapes_causal_experiment_is_diffusion_forcing():
    """+experiment=shapes_causal: block-causal (K = 4), per-block noise sorted along time, history,
    on clips of up to 8 frames; it passes the checks before step 0."""
    cfg = compose_config(["+experiment=shapes_causal"])
    check_config(cfg)
    assert cfg.model.causal_block_frames == 4 and cfg.data.max_frames == 8
    assert (cfg.loss.frame_noise, cfg.loss.block_noise_schedule, cfg.loss.history_prob) == ("block", "nondecreasing", 0.5)
