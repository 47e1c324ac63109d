"""Deferred normalization API: N forward_backward calls + optim_step(normalization) equals
the trainer's reductions, on one process and on dp×cp layouts."""
from __future__ import annotations

import pytest
import torch

from dit_train.engine.layout_equivalence import apply_layout, relative_difference

STEPS = 2
SPLITS = [1, 3]  # uneven call boundaries inside each global batch: [:1], [1:3], [3:]


def _session_weights(cfg, loss_name, normalization, calls):
    from dit_train.data_pipelines.packing import step_samples
    from dit_train import session as S

    sess = S.TrainingSession(cfg)
    init = sess.state_dict()
    loss_fn = {"token_sum": S.token_sum_loss, "sequence_mean_sum": S.sequence_mean_sum_loss,
               "token_mean": S.token_mean_loss}[loss_name]()
    for step in range(STEPS):
        ids = step_samples(step, len(sess.task.lengths()), cfg.train.global_batch, cfg.train.seed)
        bounds = [0, *SPLITS, len(ids)] if calls > 1 else [0, len(ids)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            sess.forward_backward(ids[a:b], loss_fn)
        sess.optim_step(normalization)
    final = sess.state_dict()
    return {f"__init__/{k}": v for k, v in init.items()} | final if sess.ctx.is_main else {}


def _trainer_weights(cfg, reduction):
    from dit_train.engine.layout_equivalence import train_weights

    c = apply_layout(cfg, {}, reduction)
    c.train.steps = STEPS
    return train_weights([c])[0]


CASES = [
    # (name, session loss, normalization, trainer reduction)
    ("token_mean", "token_sum", "num_loss_tokens", "token_mean"),
    ("sample_sum", "token_sum", "num_sequences", "sample_sum"),
    ("sample_mean", "sequence_mean_sum", "num_sequences", "sample_mean"),
    ("sum", "token_sum", "none", "sum"),
]


ALL_VARIANTS = ("one_call", "uneven_calls", "trainer")


def _worker(cfg, variants=ALL_VARIANTS, cases=None):
    out = {}
    for name, loss, norm, reduction in CASES:
        if cases is not None and name not in cases:
            continue
        if "one_call" in variants:
            out[(name, "one_call")] = _session_weights(cfg, loss, norm, calls=1)
        if "uneven_calls" in variants:
            out[(name, "uneven_calls")] = _session_weights(cfg, loss, norm, calls=3)
        if "trainer" in variants:
            out[(name, "trainer")] = _trainer_weights(cfg, reduction)
    return out


@pytest.fixture(scope="module")
def session_cfg(tiny_cfg):
    cfg = apply_layout(tiny_cfg, {})
    # one block: the runs are Python-bound (a step costs its blocks' calls, not their width), and the
    # calls' counts, their sync and the deferred reduction need no second transformer block
    cfg.model.depth = 1
    cfg.optim.lr = 0.05  # `sum` has un-normalized gradients: keep the step small
    return cfg


@pytest.fixture(scope="module")
def one_process(session_cfg):
    return _worker(session_cfg)


def _check(results, reference):
    """Every session variant in `results` (and, where present on another layout, that layout's
    trainer) against the one-process trainer's weights, for each case `results` holds. The
    reference's own trainer row is not compared with itself."""
    names = {name for name, _ in results}
    assert names, "nothing to compare"
    for name in names:
        ref = reference[(name, "trainer")]
        variants = [v for v in ALL_VARIANTS if (name, v) in results and not (v == "trainer" and results is reference)]
        assert variants, f"{name}: nothing to compare"
        for variant in variants:
            rel = relative_difference(ref, results[(name, variant)])
            assert rel <= 1e-4, f"{name} {variant}: {rel:.2e}"


def test_session_equals_trainer_on_one_process(one_process):
    _check(one_process, one_process)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"dp_shard": 2, "cp_ulysses": 2}, {"dp_shard": 2, "dp_mode": "ddp"},
                                    {"dp_replicate": 2, "cp_ring": 2, "cp_fsdp_mode": "none"}])
def test_session_equals_trainer_across_layouts(layout, session_cfg, one_process):
    from dit_train.engine.launch import launch_local
    from dit_train.parallel.mesh import ParallelDims

    # uneven calls only: one call is the same code path (checked on one process), and the trainer
    # on these layouts is test_layouts' job. Two cases: token_mean (N over DP x CP) and sample_mean
    # (per-sequence means: T_b within CP, B across DP) use both losses and every synced count;
    # sample_sum and sum normalize by a subset of them (all four: on one process above)
    cfg = apply_layout(session_cfg, layout)
    got = launch_local(_worker, (cfg, ("uneven_calls",), ("token_mean", "sample_mean")),
                       ParallelDims.from_config(cfg.parallel).world, cfg.launcher)[0]
    assert {name for name, _ in got} == {"token_mean", "sample_mean"}
    _check(got, one_process)


def _comm_worker(cfg):
    """Gradient reductions issued by 3 forward_backward calls + optim_step."""
    import torch.distributed as dist

    from dit_train.data_pipelines.packing import step_samples
    from dit_train.session import TrainingSession, token_sum_loss

    sess = TrainingSession(cfg)
    ids = step_samples(0, len(sess.task.lengths()), cfg.train.global_batch, cfg.train.seed)
    names = ("reduce_scatter_single", "all_reduce")
    orig = {n: getattr(dist, n) for n in names}
    counts = {"calls": {n: 0 for n in names}, "step": {n: 0 for n in names}}

    def wrap(phase, n):
        def f(*a, **kw):
            counts[phase][n] += 1
            return orig[n](*a, **kw)
        return f

    try:
        for n in names:
            setattr(dist, n, wrap("calls", n))
        for a, b in [(0, 2), (2, 4), (4, 6)]:
            sess.forward_backward(ids[a:b], token_sum_loss())
        for n in names:
            setattr(dist, n, wrap("step", n))
        sess.optim_step("num_loss_tokens")
    finally:
        for n in names:
            setattr(dist, n, orig[n])
    return counts


@pytest.mark.slow
def test_gradients_are_reduced_once_per_optim_step(session_cfg):
    from dit_train.engine.launch import launch_local

    cfg = apply_layout(session_cfg, {"dp_shard": 2})
    counts = launch_local(_comm_worker, (cfg,), 2, cfg.launcher)[0]
    assert counts["calls"]["reduce_scatter_single"] == 0, counts  # calls only accumulate
    assert counts["calls"]["all_reduce"] == 3, counts  # metadata sync only: one DP count all-reduce per call
    assert counts["step"]["reduce_scatter_single"] > 0, counts  # one flush at optim_step


def test_double_normalization_is_refused_and_none_leaves_gradients_alone(session_cfg):
    from dit_train.data_pipelines.packing import step_samples
    from dit_train.session import DoubleNormalizationError, TrainingSession, token_mean_loss, token_sum_loss

    sess = TrainingSession(session_cfg)
    ids = step_samples(0, len(sess.task.lengths()), 6, 0)
    sess.forward_backward(ids, token_mean_loss())
    with pytest.raises(DoubleNormalizationError, match="normalized twice"):
        sess.optim_step("num_loss_tokens")
    # the refusal changed nothing: gradients are still there and 'none' takes them as they are
    grads = {n: p.grad.clone() for n, p in sess.model.named_parameters()}
    before = {n: p.detach().clone() for n, p in sess.model.named_parameters()}
    sess.optimizer.param_groups[0]["lr"] = 1.0
    sess.scheduler.base_lrs = [1.0]
    sess.cfg.optim.max_grad_norm = 0.0
    sess.optim_step("none", max_grad_norm=0.0)
    for n, p in sess.model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), grads[n], atol=1e-6, rtol=1e-5)
    # raw sums with "none": gradients are the raw sums (no division)
    out = sess.forward_backward(ids, token_sum_loss())
    assert out["num_loss_tokens"] > 0 and out["num_sequences"] == 6
