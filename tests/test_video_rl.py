"""Video reward losses through the session (docs/video-rl.md): DiffusionNFT, Flow-GRPO and
Diffusion-DPO over several optimizer steps of uneven calls equal an independent one-process
computation — a plain model, one forward per clip (its noise drawn by hand), the loss written
out as the paper's formula, SGD by hand — on one process and on dp × cp layouts; rollouts are
the same on every rank and layout; bad data is refused by name."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dit_train.engine.layout_equivalence import apply_layout, relative_difference
from dit_train.posttrain import (VideoDatum, diffusion_dpo_loss, diffusion_nft_loss, flow_grpo_loss,
                                 group_advantages, sft_loss, transitions)
from tests.conftest import TINY, compose_config
from tests.test_posttrain import plain_model

TOL = 1e-4  # weights: max |Δ| relative to the largest update (see layout_equivalence)
# no caption dropout: the oracle conditions every clip on its caption (raft's sft_loss would drop
# 10% of them; the reward losses never drop)
# depth 1: the tiny runs are Python-bound (a step costs its blocks' calls, not their width); what
# the layouts must get right (clips split over CP, the counts summed, FSDP2/DDP over the root and
# a block, the same rollouts on every rank) does not need a second block
EXTRA = ["train.sample_steps=3", "optim.lr=0.05", "data.caption_dropout=0", "model.depth=1"]
CAPTIONS = ["a red circle moving up and left on a navy background",
            "a blue square moving down and right on a black background"]
SIZES = [(4, 32, 32), (2, 48, 32)]  # uneven clips: 32 and 24 tokens at 2x8x8 patches
# (recipe, per-step call boundaries): several steps, calls of uneven sizes
PLAN = {"nft": [[1, 3], []], "nft_old": [[2], [1, 4]], "dpo": [[2], [4]], "grpo": [[3, 4], [5]],
        "raft": [[2], [1, 3]]}
LOSSES = {"nft": (diffusion_nft_loss(beta=0.7, adv_clip=1.5), "num_loss_tokens"),
          "nft_old": (diffusion_nft_loss(beta=0.7, adv_clip=1.5), "num_loss_tokens"),  # + an old policy's v_old
          "dpo": (diffusion_dpo_loss(beta=50.0), "num_sequences"),
          "grpo": (flow_grpo_loss(clip_range=0.02, kl_coef=0.3), "num_sequences"),
          "raft": (sft_loss(agg="sequence"), "num_sequences")}


# -- the one-process oracle ---------------------------------------------------------------------------


def clip_velocity(cfg, model, x, t, caption):
    """(v [T, D], x_t tokens [T, D]) of one clip alone: the model's velocity at noise level t."""
    from dit_train.kernels import VarlenLayout
    from dit_train.objectives.flow_matching import velocity_from_output
    from dit_train.tasks.captions import ByteCaptionEncoder
    from dit_train.tasks.video import patchify

    m = cfg.model
    tokens, grid = patchify(x, tuple(m.patch_size))
    T = tokens.shape[0]
    seg = torch.zeros(T, dtype=torch.long)
    emb = ByteCaptionEncoder(m.text_dim, m.text_len, words=m.caption_words)(caption)
    out = model(tokens, grid, seg, torch.tensor([t]), VarlenLayout.build(seg, torch.arange(T), False),
                context=emb[None], context_len=torch.tensor([emb.shape[0]])).float()
    return velocity_from_output(out, tokens, t, m.prediction, m.x0_min_t), tokens


def clip_error(cfg, model, d, step):
    """Per-token velocity error of a VideoDatum at `step`: (v, u) with its noise drawn by hand."""
    from dit_train.objectives.flow_matching import noisy_sample, sample_shift
    from dit_train.tasks.video import num_patches, patchify

    lc, patch = cfg.loss, tuple(cfg.model.patch_size)
    shift = sample_shift(lc.timestep_shift, lc.shift_reference_tokens, num_patches(d.pixels.shape, patch))
    xt, u, t = noisy_sample(d.pixels, cfg.train.seed, d.noise_key, step, lc, shift)
    v, _ = clip_velocity(cfg, model, xt, t, d.caption)
    return v, patchify(u, patch)[0]


def oracle_loss(cfg, recipe, model, batch, step):
    if recipe in ("nft", "nft_old"):  # token mean of r·|v⁺ − u|² + (1 − r)·|v⁻ − u|²
        from dit_train.tasks.video import patchify
        beta, total, n = 0.7, 0.0, 0
        for d in batch:
            v, u = clip_error(cfg, model, d, step)
            r = 0.5 + 0.5 * max(-1.0, min(1.0, d.advantages / 1.5))
            old = v.detach() if d.old_velocity is None else patchify(d.old_velocity, tuple(cfg.model.patch_size))[0]
            pos, neg = (1 - beta) * old + beta * v, (1 + beta) * old - beta * v
            total = total + (r * (pos - u).pow(2).mean(-1) + (1 - r) * (neg - u).pow(2).mean(-1)).sum()
            n += v.shape[0]
        return total / n
    if recipe == "raft":  # the hierarchical mean: over clips of each clip's token mean of |v − u|²
        errs = [(lambda vu: (vu[0] - vu[1]).pow(2).mean())(clip_error(cfg, model, d, step)) for d in batch]
        return sum(errs) / len(errs)
    if recipe == "dpo":  # −log σ(−β·((m_c − ref_c) − (m_r − ref_r))), mean over pairs
        errs = [(lambda vu: (vu[0] - vu[1]).pow(2).mean())(clip_error(cfg, model, d, step)) for d in batch]
        losses = [-F.logsigmoid(-50.0 * ((errs[k] - batch[k].ref_loss) - (errs[k + 1] - batch[k + 1].ref_loss)))
                  for k in range(0, len(batch), 2)]
        return sum(losses) / len(losses)
    assert recipe == "grpo"  # per transition: clipped ratio of its mean log-prob + KL; mean
    from dit_train.tasks.video import patchify

    total = 0.0
    for tr in batch:
        v, x = clip_velocity(cfg, model, tr.latents, tr.sigma, tr.caption)
        x, v = x.double(), v.double()
        dt = tr.sigma_next - tr.sigma
        mean = x * (1 + tr.s ** 2 * dt / (2 * tr.sigma)) + v * (1 + tr.s ** 2 * (1 - tr.sigma) / (2 * tr.sigma)) * dt
        nxt = patchify(tr.next_latents, tuple(cfg.model.patch_size))[0].double()
        logp = (-(nxt - mean) ** 2 / (2 * tr.std ** 2) - torch.log(torch.tensor(tr.std, dtype=torch.float64))
                - 0.5 * torch.log(torch.tensor(2 * torch.pi, dtype=torch.float64))).mean()
        ratio = torch.exp(logp - tr.old_logprob)
        a = tr.advantages
        pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.98, 1.02))
        ref = patchify(tr.ref_mean, tuple(cfg.model.patch_size))[0].double()
        total = total + pg + 0.3 * ((mean - ref) ** 2).mean() / (2 * tr.std ** 2)
    return total / len(batch)


# -- the data: rollouts of the initial model ------------------------------------------------------------


def make_batches(cfg):
    """nft: 5 clips (two captions, uneven sizes) with group advantages; dpo: 3 pairs with the
    reference's errors; grpo: the transitions of 3 SDE rollouts with the reference's means;
    raft: the accepted clips (4, then 5) without advantages."""
    from dit_train.posttrain import TrainingSession

    sess = TrainingSession(cfg)
    caps = [CAPTIONS[0]] * 3 + [CAPTIONS[1]] * 2
    clips = [r.clip.clamp(-1, 1) for r in sess.sample_videos(caps[:3], SIZES[0], noise_ids=[0, 1, 2])]
    clips += [r.clip.clamp(-1, 1) for r in sess.sample_videos(caps[3:], SIZES[1], noise_ids=[3, 4])]
    adv = [1.2, -0.3, -0.9, 2.0, -2.0]
    nft = [VideoDatum(pixels=c, caption=p, noise_key=10 + i, advantages=a) for i, (c, p, a) in enumerate(zip(clips, caps, adv))]
    pairs = [VideoDatum(pixels=c, caption=p, noise_key=20 + i) for i, (c, p) in enumerate(zip(clips[:4], caps[:2] + caps[3:]))]
    pairs += [VideoDatum(pixels=clips[2], caption=caps[2], noise_key=30), VideoDatum(pixels=clips[0], caption=caps[0], noise_key=31)]
    dpo, refs = [], []
    for step in range(len(PLAN["dpo"])):  # the reference (initial weights) at each step's noise, shifted
        refs.append(sess.clip_losses(pairs, step=step))  # apart so that the margins are not 0
        dpo.append([VideoDatum(pixels=d.pixels, caption=d.caption, noise_key=d.noise_key, ref_loss=r + 0.002 * k)
                    for k, (d, r) in enumerate(zip(pairs, refs[-1]))])
    rollouts = sess.sample_videos(caps[:3], SIZES[0], noise_ids=[5, 6, 7], sde=True, guidance_scale=1.0)
    grpo = [t for r, a in zip(rollouts, group_advantages([0.2, 0.9, 0.4], 3)) for t in transitions(r, a)]
    g = torch.Generator().manual_seed(3)
    for t, mean in zip(grpo, sess.transition_means(grpo)):
        t.ref_mean = mean + 0.01 * torch.randn(mean.shape, generator=g)  # a reference apart from the policy
    raft = [VideoDatum(pixels=d.pixels, caption=d.caption, noise_key=40 + i) for i, d in enumerate(nft)]
    # nft_old: each step's clips with an old policy's velocities (the initial weights' at that
    # step's noise, moved off them so that the proximal term pulls)
    velocities = [sess.clip_velocities(nft, step=step) for step in range(len(PLAN["nft_old"]))]
    nft_old = [[replace(d, old_velocity=v + 0.05 * torch.randn(v.shape, generator=g)) for d, v in zip(nft, vs)]
               for vs in velocities]
    batches = {"nft": [nft] * 2, "nft_old": nft_old, "dpo": dpo, "grpo": [grpo] * 2, "raft": [raft[1:], raft]}
    return batches, rollouts, refs[0], velocities[0]


def session_steps(cfg, ctx, recipe, batches, with_init: bool = True):
    """The plan's optim steps of `recipe`, each over uneven calls; returns (weights, last stats).
    with_init=False leaves out the initial weights (a gather under FSDP): a result compared with
    the oracle's needs none (relative_difference measures the update on the reference)."""
    from dit_train.posttrain import TrainingSession

    sess = TrainingSession(cfg, ctx=ctx)
    init = sess.state_dict() if with_init else {}
    loss, norm = LOSSES[recipe]
    for splits, batch in zip(PLAN[recipe], batches[recipe]):
        bounds = [0, *splits, len(batch)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            sess.forward_backward(batch[a:b], loss)
        stats = sess.optim_step(norm)
    final = sess.state_dict()
    return ({f"__init__/{k}": v for k, v in init.items()} | final if sess.ctx.is_main else {}), stats


def _worker(cfg, layouts, batches):
    from dit_train.parallel.mesh import init_parallel
    from dit_train.posttrain import TrainingSession

    out = {}
    for key, layout in layouts.items():
        c = apply_layout(cfg, layout)
        ctx = init_parallel(c.parallel)
        for recipe in PLAN:
            out[(key, recipe)] = session_steps(c, ctx, recipe, batches, with_init=False)
        sess = TrainingSession(c, ctx=ctx)
        out[(key, "rollouts")] = sess.sample_videos(CAPTIONS[:1] * 3, SIZES[0], noise_ids=[5, 6, 7], sde=True,
                                                    guidance_scale=1.0)
        out[(key, "clip_losses")] = sess.clip_losses(batches["dpo"][0], step=0)
        out[(key, "clip_velocities")] = sess.clip_velocities(batches["nft"][0], step=0)
    return out


# -- tests ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return apply_layout(compose_config([*TINY, *EXTRA], cache_dir=tiny_cfg.data.cache_dir), {})


@pytest.fixture(scope="module")
def data(cfg):
    return make_batches(cfg)


@pytest.fixture(scope="module")
def oracle(cfg, data):
    batches = data[0]
    return {recipe: oracle_weights_per_step(cfg, recipe, batches[recipe]) for recipe in PLAN}


def oracle_weights_per_step(cfg, recipe, steps_batches):
    """oracle_weights with each step's own batch (DPO's references differ per step)."""
    model = plain_model(cfg)
    init = {f"__init__/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for step, batch in enumerate(steps_batches):
        model.zero_grad()
        oracle_loss(cfg, recipe, model, batch, step).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= cfg.optim.lr * p.grad
    return init | {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_process_matches_the_oracle(cfg, data, oracle):
    from dit_train.parallel.mesh import init_parallel

    batches = data[0]
    ctx = init_parallel(cfg.parallel)
    stats = {}
    for recipe in PLAN:
        weights, stats[recipe] = session_steps(cfg, ctx, recipe, batches)
        rel = relative_difference(oracle[recipe], weights)
        assert rel <= TOL, f"{recipe}: weights differ from the one-process oracle by {rel:.2e} of the update"
    assert 0 < stats["grpo"]["clip_fraction"] < 1  # the second GRPO step is off-policy: some ratios clip


@pytest.mark.slow
def test_layouts_match_the_oracle_and_roll_out_the_same_clips(cfg, data, oracle):
    """One launch of 4 workers: dp_shard × cp_ring (FSDP2 over dp·cp), DDP × Ulysses, ring ×
    Ulysses; every recipe's weights equal the oracle's; rollouts and the reference's errors are
    identical on every rank and equal the one-process ones."""
    from dit_train.engine.launch import launch_local

    batches, rollouts, refs, velocities = data
    layouts = {"dp2_ring2": {"dp_shard": 2, "cp_ring": 2},
               "ddp2_ulysses2": {"dp_shard": 2, "dp_mode": "ddp", "cp_ulysses": 2},
               "ring2_ulysses2": {"cp_ring": 2, "cp_ulysses": 2}}
    results = launch_local(_worker, (cfg, layouts, batches), 4, cfg.launcher)
    for key in layouts:
        for recipe in PLAN:
            rel = relative_difference(oracle[recipe], results[0][(key, recipe)][0])
            assert rel <= TOL, f"{key} {recipe}: weights differ from the oracle by {rel:.2e} of the update"
        mine = results[0][(key, "rollouts")]
        for rank in results:
            for a, b in zip(mine, results[rank][(key, "rollouts")]):
                assert all(torch.equal(x, y) for x, y in zip(a.latents, b.latents)) and a.log_probs == b.log_probs
            assert results[rank][(key, "clip_losses")] == results[0][(key, "clip_losses")]
        for a, b in zip(rollouts, mine):
            torch.testing.assert_close(a.clip, b.clip, atol=1e-4, rtol=1e-4)
            assert a.log_probs == pytest.approx(b.log_probs, rel=1e-4, abs=1e-4)
        assert results[0][(key, "clip_losses")] == pytest.approx(refs, rel=1e-4)
        for rank in results:  # the old policy's velocities: every token once, on every rank, as one process
            for a, b in zip(velocities, results[rank][(key, "clip_velocities")]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_bad_video_data_is_refused_naming_the_datum(cfg, data):
    """Pairs of different captions, a rollout of another run, a missing advantage, and the
    video losses in an LM session: one ValueError each, naming the datum; nothing accumulated."""

    from dit_train.posttrain import TrainingSession

    batches = data[0]
    sess = TrainingSession(cfg)
    chosen, rejected = batches["dpo"][0][:2]
    other = replace(rejected, caption="a green square moving up and left on a gray background")
    with pytest.raises(ValueError, match="datum 1: caption 'a green square.*differs from its chosen clip's"):
        sess.forward_backward([chosen, other], diffusion_dpo_loss())
    trs = batches["grpo"][0][:3]
    with pytest.raises(ValueError, match="datum 2: run is 'deadbeef': this rollout was sampled by another run"):
        sess.forward_backward([*trs[:2], replace(trs[2], run="deadbeef")], flow_grpo_loss(kl_coef=0.1))
    with pytest.raises(ValueError, match="datum 1: ref_mean is required by the KL term"):
        sess.forward_backward([trs[0], replace(trs[1], ref_mean=None)], flow_grpo_loss(kl_coef=0.1))
    nft = batches["nft"][0]
    with pytest.raises(ValueError, match="datum 1: advantages is required by this loss"):
        sess.forward_backward([nft[0], replace(nft[1], advantages=None)], diffusion_nft_loss())
    with pytest.raises(ValueError, match="datum 0: advantages is nan"):
        sess.forward_backward([replace(nft[0], advantages=float("nan"))], diffusion_nft_loss())
    old = torch.zeros(nft[0].pixels.shape)
    with pytest.raises(ValueError, match=r"datum 1: old_velocity is missing but datum 0 has it"):
        sess.forward_backward([replace(nft[0], old_velocity=old), nft[1]], diffusion_nft_loss())
    with pytest.raises(ValueError, match=r"datum 0: old_velocity has shape \[4, 32, 32\]; expected the clip's"):
        sess.forward_backward([replace(nft[0], old_velocity=old[0])], diffusion_nft_loss())
    with pytest.raises(TypeError, match="datum 0 is a VideoDatum; flow_grpo_loss takes VideoTransition"):
        sess.forward_backward(nft[:1], flow_grpo_loss())
    assert sess.num_loss_tokens == 0
    lm = TrainingSession(compose_config(["mode=llm", "model.dim=32", "model.depth=2", "model.heads=4"]))
    with pytest.raises(ValueError, match="diffusion_nft_loss trains a video generator: mode=video only"):
        lm.forward_backward(nft[:1], diffusion_nft_loss())


def nan_reward(clips, captions):
    return [float("nan")] * len(clips)


def short_reward(clips, captions):
    return [1.0] * (len(clips) - 1)


def test_the_recipe_tool_refuses_bad_rewards_in_one_line(cfg, tmp_path, capsys):
    """video_rl with a reward returning NaN or the wrong count, or a folder that is no run: one
    `error:` line naming the clip / flag, exit 2, no weights written."""
    from dit_train.posttrain import TrainingSession
    from dit_train.tools.video_rl import main

    run = tmp_path / "run"
    TrainingSession(cfg).export(run)
    common = [str(run), "--recipe", "nft", "--steps", "1", "--captions", "1", "--group", "2", "--sample-steps", "1",
              "--eval-every", "0", "--out", str(tmp_path / "out")]
    for reward, message in (("tests.test_video_rl:nan_reward", "returned nan for clip 0 ('a "),
                            ("tests.test_video_rl:short_reward", "returned 1 values for 2 clips"),
                            ("tests.test_video_rl:no_such", "cannot load it")):
        assert main([*common, "--reward", reward]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --reward") and message in err[0], err
    assert main([str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no config.yaml there" in capsys.readouterr().err
    assert not (tmp_path / "out" / "weights.safetensors").exists()


def test_raft_keeps_exactly_the_all_ok_clips_and_every_rank_draws_the_same_batches(monkeypatch):
    """Under the shapes reward, --keep-min 5.5 accepts a clip iff all_ok (every pass/fail pattern
    of the figures, palette_share at its extremes); two buffers fed alike draw the same datums,
    with distinct noise keys, and keep only the newest `capacity` clips."""
    import itertools

    from dit_train.posttrain.rollouts import VideoRollout
    from dit_train.tools import video_rl, video_rl_rewards

    patterns = [dict(zip(("background_ok", "color_ok", "shape_ok", "motion_ok", "single_shape"), map(float, bits)),
                     palette_share=p) for bits in itertools.product((0, 1), repeat=5) for p in (0.0, 0.5, 1.0)]
    for s in patterns:
        s["all_ok"] = float(all(s[k] for k in ("background_ok", "color_ok", "shape_ok", "motion_ok")))
    patterns = [s for s in patterns if not (s["background_ok"] and s["palette_share"] < 0.5)]  # bg_ok: >= 50% palette
    monkeypatch.setattr(video_rl_rewards, "score_clip", lambda clip, caption: patterns[int(clip)])
    rewards = video_rl.shapes_reward(list(range(len(patterns))), [""] * len(patterns))
    assert video_rl.accepted(rewards, 5.5) == [i for i, s in enumerate(patterns) if s["all_ok"]]

    rollouts = [VideoRollout(f"caption {i}", i, torch.full((3, 2, 4, 4), i / 10), "run") for i in range(6)]
    a, b = video_rl.RaftBuffer(capacity=4), video_rl.RaftBuffer(capacity=4)
    for buf in (a, b):
        buf.add(rollouts, [0, 2, 3])
        buf.add(rollouts, [4, 5])
    assert [c for _, c in a.clips] == ["caption 2", "caption 3", "caption 4", "caption 5"] and a.added == 5
    for _ in range(3):
        x, y = a.batch(3), b.batch(3)
        assert [d.caption for d in x] == [d.caption for d in y] and [d.noise_key for d in x] == [0, 1, 2]
        assert len({d.caption for d in x}) == 3 and all(torch.equal(d.pixels, e.pixels) for d, e in zip(x, y))
    assert len(a.batch(10)) == 4


def test_raft_best_keeps_each_groups_first_best_clip_above_the_floor():
    """--raft-select best: one clip per caption's group, its highest reward (the first on a tie),
    and none from a group whose best is below --keep-min; a short last group counts too."""
    from dit_train.tools.video_rl import accepted

    rewards = [1.0, 6.0, 5.8, 6.0,   # best 6.0 twice: the first (1)
               2.0, 4.9, 4.0, 3.0,   # best 4.9 < 5.0: none
               5.0, 0.0, 0.0, 0.0,   # best exactly the floor: kept (8)
               0.5, 7.0]             # a short group of 2: its best (13)
    assert accepted(rewards, 5.0, group=4, select="best") == [1, 8, 13]
    assert accepted(rewards, 5.0, group=4, select="all") == [1, 2, 3, 8, 13]
    assert accepted(rewards, 0.0, group=2, select="best") == [1, 3, 5, 6, 8, 10, 13]


def test_raft_waits_for_its_buffer_and_the_sft_baseline_trains_on_the_runs_clips(cfg, tmp_path):
    """video_rl end to end on the tiny run: raft with --raft-select best keeps one clip of a group
    of 2 (--keep-min below any reward), so --raft-min-buffer 2 takes no optimizer step (weights
    unchanged) and --raft-min-buffer 1 takes one; --recipe sft steps on the run's own data."""
    from safetensors.torch import load_file

    from dit_train.posttrain import TrainingSession
    from dit_train.tools.video_rl import main

    run = tmp_path / "run"
    TrainingSession(cfg).export(run)
    start = load_file(run / "weights.safetensors")
    common = [str(run), "--steps", "1", "--captions", "1", "--group", "2", "--sample-steps", "1", "--eval-every", "0"]
    raft = ["--recipe", "raft", "--raft-select", "best", "--keep-min", "-1"]

    def changed(out: str, *flags: str) -> bool:
        assert main([*common, *flags, "--out", str(tmp_path / out)]) == 0
        after = load_file(tmp_path / out / "weights.safetensors")
        return any(not torch.equal(after[k], start[k]) for k in start)

    assert not changed("wait", *raft, "--raft-min-buffer", "2")
    assert changed("step", *raft, "--raft-min-buffer", "1")
    assert changed("sft", "--recipe", "sft", "--updates", "1", "--raft-batch", "2")


def test_the_tool_post_trains_a_muon_run_with_adamw(cfg, tmp_path):
    """A from-scratch run trained with Muon (the default) is post-trained with AdamW, the optimizer
    the recipes' learning rates are for; optim.name=muon after the flags keeps Muon."""
    import copy

    from omegaconf import OmegaConf

    from dit_train.config.choices import OptimName
    from dit_train.posttrain import TrainingSession
    from dit_train.tools.video_rl import main

    muon = copy.deepcopy(cfg)
    muon.optim.name = OptimName.muon
    run = tmp_path / "run"
    TrainingSession(muon).export(run)
    assert OmegaConf.load(run / "config.yaml").optim.name == "muon"
    common = [str(run), "--steps", "1", "--recipe", "sft", "--updates", "1", "--raft-batch", "2", "--eval-every", "0"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert OmegaConf.load(tmp_path / "a" / "config.yaml").optim.name == "adamw"
    assert main([*common, "--out", str(tmp_path / "m"), "optim.name=muon"]) == 0
    assert OmegaConf.load(tmp_path / "m" / "config.yaml").optim.name == "muon"


# -- Flow-GRPO's direction: the sanity check's property on the tiny model ---------------------------------


def offset_gradients(cfg, sess, rollouts, batch):
    """(Flow-GRPO's ascent, the exact gradient of the rollouts' mean brightness) along the model's
    output offset (final.linear.bias summed): the first from `batch` through the session, the
    second by differentiating each recorded SDE path with its noise held (ε_k recovered from the
    recorded x_{k+1}), one clip alone at a time."""
    from dit_train.kernels import VarlenLayout
    from dit_train.objectives.flow_matching import velocity_from_output
    from dit_train.posttrain.rollouts import sde_mean
    from dit_train.tasks.captions import ByteCaptionEncoder
    from dit_train.tasks.video import patchify

    bias = dict(sess.model.named_parameters())["final.linear.bias"]
    sess.forward_backward(batch, flow_grpo_loss())
    ascent = -float(bias.grad.sum()) / len(batch)
    sess.optim_step("num_sequences")  # lr 1e-30: a reset, not a move
    m, patch = cfg.model, tuple(cfg.model.patch_size)
    total = 0.0
    for r in rollouts:
        emb = ByteCaptionEncoder(m.text_dim, m.text_len, words=m.caption_words)(r.caption)
        x, grid = patchify(r.latents[0], patch)
        seg = torch.zeros(x.shape[0], dtype=torch.long)
        layout = VarlenLayout.build(seg, torch.arange(x.shape[0]), False)
        for k, std in enumerate(r.stds):
            sig, nxt = r.sigmas[k], r.sigmas[k + 1]
            out = sess.model(x, grid, seg, torch.tensor([sig]), layout, context=emb[None],
                             context_len=torch.tensor([emb.shape[0]])).float()
            mean = sde_mean(x, velocity_from_output(out, x, sig, m.prediction, m.x0_min_t), sig, nxt,
                            std / (sig - nxt) ** 0.5)
            x = mean + (patchify(r.latents[k + 1], patch)[0] - mean.detach())  # x_{k+1}, its noise held
        total = total + (x.clamp(-1, 1).mean() + 1) / 2
    return ascent, float(torch.autograd.grad(total / len(rollouts), bias)[0].sum())


@pytest.mark.parametrize("prediction", ["x0", "velocity"])
def test_flow_grpo_pulls_the_output_offset_the_way_brightness_rises(tiny_cfg, prediction):
    """The sanity check (docs/video-rl.md) in seconds: on each of 4 batches of the tool's grpo
    (32 SDE rollouts of 3 steps, groups of 8, brightness advantages, `grpo_batch`), Flow-GRPO's
    gradient pulls the model's output offset the way the exact gradient of the rollouts' mean
    brightness does (up for x̂0, down for a velocity), for both predictions. Training on the last
    transition too (σ 1/1000 → 0, std 7e-4: `flow_grpo_steps` returning every step) fails: its
    pure-noise term outweighs the rest, and the sign came out wrong in 3 of the 4 batches for x̂0,
    in 1 for a velocity; so does flipping the advantages' sign."""
    from dit_train.posttrain import TrainingSession
    from dit_train.tools.video_rl_recipes import RaftBuffer, StepInputs, grpo_batch
    from dit_train.tools.video_rl_rewards import brightness_reward

    cfg = compose_config([*TINY, "optim.lr=1e-30", "data.caption_dropout=0", f"model.prediction={prediction}"],
                         cache_dir=tiny_cfg.data.cache_dir)
    sess = TrainingSession(cfg)
    caps = [CAPTIONS[0]] * 32
    for b in range(4):
        rollouts = sess.sample_videos(caps, (2, 8, 8), noise_ids=[1000 * b + i for i in range(32)], steps=3, sde=True,
                                      guidance_scale=1.0)
        rewards = brightness_reward([r.clip for r in rollouts], caps)
        batch, _, _ = grpo_batch(StepInputs(sess, None, rollouts, rewards, group=8, step=0, kl=0.0, buffer=RaftBuffer(),
                                            data=None, keep_min=0.0, select="all", updates=1, min_buffer=0, raft_batch=0))
        ascent, exact = offset_gradients(cfg, sess, rollouts, batch)
        assert ascent * exact > 0, (f"batch {b}: Flow-GRPO moves the output offset by {ascent:+.3e}, against the "
                                    f"brightness gradient's {exact:+.3e}")


def test_the_session_refuses_a_block_causal_model(cfg):
    """The session's datums are packed bidirectionally: a block-causal model (model.causal_block_frames)
    is refused before anything is built, not post-trained under another mask than it samples with."""
    import copy

    from dit_train.config.errors import ConfigError
    from dit_train.posttrain import TrainingSession

    c = copy.deepcopy(cfg)
    c.model.causal_block_frames = 2 * c.model.patch_size[0]
    with pytest.raises(ConfigError, match="causal_block_frames"):
        TrainingSession(c)
