"""Held-out evaluation loss in video mode: fixed noise and timesteps, exact on every layout."""
from __future__ import annotations

import pytest

from dit_train.config.errors import ConfigError
from dit_train.engine.checks import check_config
from dit_train.engine.layout_equivalence import apply_layout


@pytest.fixture(scope="module")
def eval_cfg(tiny_cfg):
    cfg = apply_layout(tiny_cfg, {})
    cfg.data.heldout_fraction, cfg.train.eval_every = 0.25, 1
    return cfg


def _heldout(cfg):
    from dit_train.engine.build import build_run

    run = build_run(cfg, heldout=True)
    first = run.trainer.heldout_loss(run.heldout)
    second = run.trainer.heldout_loss(run.heldout)
    return {"first": first, "second": second, "train_ids": len(run.task.lengths()), "heldout_ids": len(run.heldout.lengths())}


def test_heldout_clips_are_left_out_of_training_and_scored_the_same_each_time(eval_cfg, tiny_cfg):
    from dit_train.tasks import build_task

    got = _heldout(eval_cfg)
    everything = len(build_task("video", tiny_cfg.data, tiny_cfg.model, tiny_cfg.loss, 0).lengths())
    assert got["heldout_ids"] > 0 and got["train_ids"] + got["heldout_ids"] == everything
    assert got["first"] == got["second"]  # fixed noise and timesteps
    assert got["first"]["eval_tokens"] > 0 and "eval_ppl" not in got["first"]


def test_eval_every_without_heldout_clips_is_refused(tiny_cfg):
    cfg = apply_layout(tiny_cfg, {})
    cfg.train.eval_every = 10
    with pytest.raises(ConfigError, match="data.heldout_fraction"):
        check_config(cfg)


@pytest.mark.slow
def test_heldout_loss_is_layout_independent(eval_cfg):
    from dit_train.engine.launch import launch_local

    one = _heldout(eval_cfg)
    cfg = apply_layout(eval_cfg, {"dp_shard": 2, "cp_ulysses": 2})
    four = launch_local(_heldout, (cfg,), 4, cfg.launcher)[0]
    assert four["first"]["eval_tokens"] == one["first"]["eval_tokens"]
    assert abs(four["first"]["eval_loss"] - one["first"]["eval_loss"]) <= 1e-5 * one["first"]["eval_loss"]
