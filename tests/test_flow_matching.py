"""Timestep shift and loss weighting of the flow-matching objective (loss.timestep_shift,
loss.shift_reference_tokens, loss.weighting): the shifted t follows its formula, sampling uses
the same shift as training, the weighting gives the gradient it promises, and all of it stays
layout-exact."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from dit_train.config import LossConfig
from dit_train.objectives.flow_matching import (
    loss_weight,
    noisy_sample,
    sample_shift,
    sample_timestep,
    shift_timestep,
)
from dit_train.rng import sample_generator
from tests.test_text_sampling import _OracleVelocity

N_DRAWS = 10_000
QUANTILES = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)


def _draw(cfg: LossConfig, shift: float, n: int = N_DRAWS) -> torch.Tensor:
    """[n] float64 t of samples 0..n-1 at step 0, through the training path (noisy_sample)."""
    x0 = torch.zeros(1)
    return torch.tensor([noisy_sample(x0, 0, sid, 0, cfg, shift)[2] for sid in range(n)], dtype=torch.float64)


def _unshifted_cdf(cfg: LossConfig, t: torch.Tensor) -> torch.Tensor:
    """P(t_drawn <= t) of the configured distribution before any shift."""
    if cfg.timestep_sampling == "uniform":
        return t.clamp(0, 1)
    normal = torch.distributions.Normal(cfg.logit_mean, cfg.logit_std)
    return normal.cdf(torch.logit(t.clamp(1e-12, 1 - 1e-12)))


def _unshifted_quantiles(cfg: LossConfig, q: torch.Tensor) -> torch.Tensor:
    if cfg.timestep_sampling == "uniform":
        return q
    return torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.distributions.Normal(0.0, 1.0).icdf(q))


@pytest.mark.parametrize("sampling,shift", [("logit_normal", 3.0), ("uniform", 3.0), ("logit_normal", 0.5)])
def test_shifted_t_follows_the_pushforward_of_its_distribution(sampling, shift):
    """t' = s·t/(1+(s−1)·t) is increasing, so the quantiles of t' are the shifted quantiles of
    t and its CDF is F(x) = F_t(x / (s − (s−1)·x)) (the inverse shift)."""
    cfg = LossConfig(timestep_sampling=sampling, logit_mean=0.2 if sampling == "logit_normal" else 0.0)
    drawn = _draw(cfg, shift).sort().values
    want_q = shift_timestep(_unshifted_quantiles(cfg, QUANTILES), shift)
    got_q = torch.quantile(drawn, QUANTILES)
    assert (got_q - want_q).abs().max() < 0.02, (got_q - want_q).abs().max()
    # KS statistic against the exact CDF of t' (n = 10^4: 1.95/sqrt(n) ~ 0.02 is the 0.1% level)
    cdf = _unshifted_cdf(cfg, drawn / (shift - (shift - 1) * drawn))
    n = drawn.numel()
    steps = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum(steps - cdf, cdf - (steps - 1 / n)).max()
    assert ks < 1.95 / math.sqrt(n), f"KS distance {ks:.4f}"
    # the direction (checked against diffusers' scheduler in the sampler test): s > 1 means
    # more noise, t' > t; its median moves to s/(1+s) for the uniform t
    raw = torch.tensor([sample_timestep(sample_generator(0, sid, 0, "timestep"), cfg) for sid in range(200)],
                       dtype=torch.float64)
    few = _draw(cfg, shift, 200)
    assert bool((few > raw).all() if shift > 1 else (few < raw).all())
    if sampling == "uniform":
        assert abs(float(drawn.median()) - shift / (1 + shift)) < 0.02


def test_shift_one_is_the_identity_bit_for_bit():
    cfg = LossConfig()
    x0 = torch.randn(3, 2, 8, 8)
    for sid in range(50):
        raw = sample_timestep(sample_generator(7, sid, 3, "timestep"), cfg)
        assert shift_timestep(raw, 1.0) == raw
        xt, v, t = noisy_sample(x0, 7, sid, 3, cfg, 1.0)
        xt0, v0, t0 = noisy_sample(x0, 7, sid, 3, cfg)
        assert t == t0 == raw and torch.equal(xt, xt0) and torch.equal(v, v0)
    grid = torch.rand(1000)
    assert torch.equal(shift_timestep(grid, 1.0), grid)
    assert sample_shift(1.0, 0, 12345) == 1.0 and sample_shift(3.0, 0, 12345) == 3.0


def test_resolution_shift_is_a_function_of_the_sample_alone(tiny_cfg):
    """Each sample's t is shifted by shift·sqrt(T_b / reference) of its own token count,
    whatever pack it is built in."""
    from dit_train.tasks import build_task

    lc = replace(tiny_cfg.loss, timestep_shift=2.0, shift_reference_tokens=128)
    task = build_task("video", tiny_cfg.data, tiny_cfg.model, lc, 0)
    ids = [0, 1, 2, 3, 4, 5]
    together = task.build(ids, 4)
    sizes = torch.bincount(together.seg, minlength=len(ids)).tolist()
    assert len(set(sizes)) > 1, "the test needs samples of different sizes"
    for k, sid in enumerate(ids):
        alone = task.build([sid], 4)
        assert float(alone.samples["t"][0]) == float(together.samples["t"][k])
        raw = sample_timestep(sample_generator(0, sid, 4, "timestep"), lc)
        s_b = 2.0 * math.sqrt(sizes[k] / 128)
        assert float(together.samples["t"][k]) == pytest.approx(s_b * raw / (1 + (s_b - 1) * raw), rel=1e-6)


def test_loss_weights_are_diffusers_sd3_weightings():
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    t = torch.tensor([0.01, 0.2, 0.5, 0.77, 0.999])
    for scheme in ("none", "sigma_sqrt", "cosmap"):
        torch.testing.assert_close(loss_weight(t, scheme), compute_loss_weighting_for_sd3(scheme, sigmas=t))
    with pytest.raises(ValueError, match="loss.weighting"):
        loss_weight(t, "snr")


# -- sampling uses the training shift --------------------------------------------------------------

PATCH = (2, 8, 8)
SHAPES = [(3, 2, 16, 16), (3, 4, 16, 32), (3, 8, 32, 32)]  # 4, 16 and 64 tokens


def _sampler(shift: float, reference: int, steps: int = 8, ctx=None):
    from dit_train.sampling import SampleRequest, VideoSampler
    from dit_train.tasks.video_inputs import VideoInputs

    requests = [SampleRequest(f"c{k}", shape, "", None, k) for k, shape in enumerate(SHAPES)]
    return VideoSampler(requests, VideoInputs(PATCH), None, ctx, steps, 1.0, 0, shift, reference)


@pytest.mark.parametrize("shift,reference", [(3.0, 0), (3.0, 16), (1.0, 16)])
def test_sampler_sigmas_are_the_training_shift_of_the_plain_grid(shift, reference):
    from diffusers import FlowMatchEulerDiscreteScheduler

    plain = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    plain.set_timesteps(8)
    grid = plain.sigmas[:-1]  # 1 ... 1/1000
    sampler = _sampler(shift, reference)
    tokens = [4, 16, 64]
    assert sampler.shifts == [sample_shift(shift, reference, n) for n in tokens]
    for s, sched in zip(sampler.shifts, sampler.schedulers()):
        assert sched.shift == s  # diffusers' own shift does the work ...
        torch.testing.assert_close(sched.sigmas[:-1], shift_timestep(grid.double(), s).float(), rtol=1e-6, atol=0)
        assert float(sched.sigmas[-1]) == 0.0 and float(sched.sigmas[0]) == 1.0
        torch.testing.assert_close(sched.timesteps, sched.sigmas[:-1] * 1000)
        if s > 1:  # ... in the same direction as ours: every inner sigma moves towards noise
            assert bool((sched.sigmas[1:-1] > grid[1:]).all())
    # no shift: the scheduler's own default grid, bit for bit (today's validation videos)
    one = _sampler(1.0, 0).schedulers()[0]
    assert torch.equal(one.sigmas, plain.sigmas) and torch.equal(one.timesteps, plain.timesteps)




@pytest.mark.parametrize("stochastic", [False, True])
def test_sampler_with_per_clip_shifts_integrates_each_clip_to_its_data(stochastic):
    """A perfect velocity lands each clip on its data only if every clip gets its own t (the
    per-clip shifts differ here) and its own scheduler's steps — also when every step re-noises
    (the stochastic step's x̂0 = x − σ·v is then the data itself)."""
    from dit_train.config import ParallelConfig
    from dit_train.parallel.mesh import init_parallel
    from dit_train.tasks.video import patchify

    sampler = _sampler(3.0, 16, steps=5, ctx=init_parallel(ParallelConfig(device="cpu")))
    sampler.stochastic = stochastic
    assert len(set(sampler.shifts)) == 3
    data = [torch.rand(shape, generator=torch.Generator().manual_seed(k)) * 2 - 1 for k, shape in enumerate(SHAPES)]
    out = sampler.sample(_OracleVelocity(torch.cat([patchify(x, PATCH)[0] for x in data])))
    for got, want in zip(out, data):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_stochastic_sampler_draws_fresh_noise_from_the_clips_own_stream():
    """With an imperfect model the stochastic step differs from the deterministic one; it is a
    function of (seed, noise id) alone: the same twice, and a clip's result does not depend on
    which other clips are sampled with it (what keeps it equal across layouts and packs)."""
    from dit_train.config import ParallelConfig
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling import SampleRequest, VideoSampler
    from dit_train.tasks.video_inputs import VideoInputs

    ctx = init_parallel(ParallelConfig(device="cpu"))

    class Wrong(torch.nn.Module):  # a velocity that is wrong everywhere
        def forward(self, x, *args, **kw):
            return 0.5 * x

    model = Wrong()

    def run(shapes, stochastic):
        requests = [SampleRequest(f"c{k}", shape, "", None, k) for k, shape in enumerate(shapes)]
        return VideoSampler(requests, VideoInputs(PATCH), None, ctx, 6, 1.0, 0, stochastic=stochastic).sample(model)

    det, sto = run(SHAPES, False), run(SHAPES, True)
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(det, sto))
    again, first_alone = run(SHAPES, True), run(SHAPES[:1], True)
    assert all(torch.equal(a, b) for a, b in zip(sto, again))
    assert torch.equal(first_alone[0], sto[0])


# -- the weighting's gradient ----------------------------------------------------------------------


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["sample_mean", "token_mean"])
def test_weighting_gives_the_gradient_of_the_weighted_sum(tiny_cfg, reduction):
    """One pack of several samples: the trainer's SGD update is −lr × the gradient of
    Σ_b w(t_b)·Σ_{i∈b} r_i·l_i, with r the reduction's weights, l the plain per-token MSE and
    w diffusers' CosMap of each sample's (shifted) t — and that differs from the unweighted one."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    from dit_train.engine.build import build_run
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.loss import token_weights
    from dit_train.objectives.flow_matching import per_token_mse
    from dit_train.batch import video_forward

    cfg = apply_layout(tiny_cfg, {"micro_batch_tokens": 4096, "global_batch": 4}, reduction)
    cfg.loss = replace(cfg.loss, timestep_shift=3.0, shift_reference_tokens=128, weighting="cosmap")
    cfg.model = replace(cfg.model, prediction="velocity")  # the by-hand loss below takes the output as v
    cfg.optim.max_grad_norm = 0.0
    run = build_run(cfg)
    tr, model = run.trainer, run.model
    packs = tr.plan(0)
    assert len(packs) == 1 and len(packs[0]) == 4, packs
    (mb,) = tr.prepare(packs, 0)
    counts = tr.sync_counts([mb])
    b = mb.batch
    r = token_weights(reduction, b.seg, b.valid, counts, 0)
    w = compute_loss_weighting_for_sd3("cosmap", sigmas=b.samples["t"])
    assert float(w.max() - w.min()) > 0.05, "the samples' weights should differ"

    def grad(weighted: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        pred = video_forward(model, b, mb.attn)
        rl = r * per_token_mse(pred, b.tokens["target"])
        loss = sum((w[k] if weighted else 1.0) * rl[b.seg == k].sum() for k in range(b.num_samples))
        loss.backward()
        out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    by_hand, plain = grad(True), grad(False)
    before = _params(model)
    tr.step(0)
    after = _params(model)
    lr = cfg.optim.lr
    scale = max(float(g.abs().max()) for g in by_hand.values())
    for name in before:
        got = (before[name] - after[name]) / lr
        # recovered from an fp32 update: no finer than the weights' own rounding (ulp / lr)
        atol = 1e-5 * scale + 2 * torch.finfo(torch.float32).eps * float(before[name].abs().max()) / lr
        torch.testing.assert_close(got, by_hand[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    change = max(float((by_hand[n] - plain[n]).abs().max()) for n in by_hand)
    assert change > 0.01 * scale, "the weighting should change the gradient"


# -- config and resume ---------------------------------------------------------------------------------


def test_bad_shift_is_a_config_error_and_loss_changes_refuse_resume(tiny_cfg):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.engine.resume import config_changes

    bad = apply_layout(tiny_cfg, {})
    bad.loss = replace(bad.loss, timestep_shift=0.0, shift_reference_tokens=-1)
    with pytest.raises(ConfigError, match="loss.timestep_shift=0.0.*\n.*loss.shift_reference_tokens=-1"):
        check_config(bad)
    new = apply_layout(tiny_cfg, {})
    new.loss = replace(new.loss, timestep_shift=3.0, shift_reference_tokens=256, weighting="cosmap")
    changes = {c.key: c.kind for c in config_changes(tiny_cfg, new)}
    assert changes == {"loss.timestep_shift": "refused", "loss.shift_reference_tokens": "refused",
                       "loss.weighting": "refused"}


def test_sampler_changes_resume_with_a_notice(tiny_cfg):
    """Guidance and the stochastic step change what validation scores, not the weights: a resume
    takes them and says the eval/ curve changes there; the sampler's step count is plain allowed."""
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.engine.resume import config_changes

    new = apply_layout(tiny_cfg, {})
    new.train.guidance_scale, new.train.stochastic_sampling = 3.0, True
    new.train.sample_steps = 7
    changes = {c.key: c for c in config_changes(tiny_cfg, new)}
    assert {k: c.kind for k, c in changes.items()} == {
        "train.guidance_scale": "notice", "train.stochastic_sampling": "notice", "train.sample_steps": "allowed"}
    assert "not comparable" in changes["train.guidance_scale"].line()


# -- exactness ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shift_and_weighting_stay_layout_exact(tiny_cfg):
    from dit_train.engine.layout_equivalence import apply_layout, relative_difference, run_layouts

    cfg = apply_layout(tiny_cfg, {})
    cfg.loss = replace(cfg.loss, timestep_shift=3.0, shift_reference_tokens=128, weighting="cosmap")
    got = run_layouts(cfg, ["1", "dp_shard=2,cp_ulysses=2"], ["sample_mean", "token_mean"])
    for reduction, ref, other in zip(["sample_mean", "token_mean"], got["1"], got["dp_shard=2,cp_ulysses=2"]):
        rel = relative_difference(ref, other)
        assert rel <= 1e-4, f"{reduction}: weights differ by {rel:.2e} of the update"
