"""EMA of the weights: the warm-up rule, skipped steps leave it alone, sampling swaps it in and
out. (Exactness across layouts: tests/test_layouts.py; resume: tests/test_checkpoint.py.)"""
from __future__ import annotations

import torch

from dit_train.engine.layout_equivalence import apply_layout


def _poison_step(run, bad_step: int):
    """Make the per-token loss NaN at `bad_step` (the whole step is then skipped)."""
    orig = run.trainer.per_token_loss
    state = {"step": -1}

    def per_token_loss(mb, task=None):
        out = orig(mb, task)
        return out + float("nan") if state["step"] == bad_step else out

    run.trainer.per_token_loss = per_token_loss
    return state


def test_ema_follows_the_rule_and_ignores_skipped_steps(tiny_cfg):
    from dit_train.engine.build import build_run
    from dit_train.engine.ema import trainable_parameters

    cfg = apply_layout(tiny_cfg, {})
    cfg.train.ema_decay, cfg.train.steps = 0.95, 4
    run = build_run(cfg)
    params = trainable_parameters(run.model)
    init = {n: p.detach().clone() for n, p in params.items()}
    state = _poison_step(run, bad_step=1)
    shadows = []
    for step in range(4):
        state["step"] = step
        res = run.trainer.step(step)
        assert res.skipped == (step == 1)
        shadows.append({n: t.clone() for n, t in run.ema.shadow.items()})
        if step == 0:  # first update: d = min(0.95, 1/10) = 0.1
            for n, p in params.items():
                torch.testing.assert_close(shadows[0][n], 0.1 * init[n] + 0.9 * p.detach(), rtol=1e-6, atol=1e-6)
    assert run.ema.updates == 3  # step 1 was skipped: no update
    assert all(torch.equal(shadows[1][n], shadows[0][n]) for n in params)  # skipped step: EMA untouched
    d = min(0.95, 3 / 12)  # the third update (n = 2) after the weights of step 3
    for n, p in params.items():
        torch.testing.assert_close(shadows[3][n], d * shadows[2][n] + (1 - d) * p.detach(), rtol=1e-6, atol=1e-6)


def test_swapped_in_restores_the_training_weights(tiny_cfg):
    from dit_train.engine.build import build_run

    cfg = apply_layout(tiny_cfg, {})
    cfg.train.ema_decay = 0.9
    run = build_run(cfg)
    run.trainer.step(0)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    with run.ema.swapped_in():
        for n, p in run.model.named_parameters():
            assert torch.equal(p.detach(), run.ema.shadow[n]), n
    assert all(torch.equal(p.detach(), before[n]) for n, p in run.model.named_parameters())
