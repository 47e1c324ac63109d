"""Distributed mechanics: metadata sync values, gradient communication per step, launcher."""
from __future__ import annotations

import pytest
import torch

from dit_train.engine.layout_equivalence import apply_layout


def _meta_worker(cfg):
    """Sync metadata on a dp×cp layout; return what this rank sees plus its sample ids."""
    from dit_train.tasks import build_task
    from dit_train.parallel.mesh import init_parallel
    from dit_train.engine.trainer import Trainer

    ctx = init_parallel(cfg.parallel)
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    trainer = Trainer(torch.nn.Linear(1, 1), task, None, None, ctx, cfg.train, cfg.optim, cfg.loss, cfg.parallel)
    micro = trainer.prepare(trainer.plan(1), 1)
    meta = trainer.sync_counts(micro)
    T = {int(sid): int(t) for m, ts in zip(micro, meta.sample_tokens) for sid, t in zip(m.batch.sample_ids, ts)}
    return {"T": T, "B": meta.num_samples, "N": meta.num_tokens, "world": meta.world}


@pytest.mark.slow
def test_metadata_sync_equals_single_process_counts(tiny_cfg):
    """T_b summed within CP (a sample split over CP ranks is counted whole), B over DP only,
    N over DP×CP: compared with the counts of one process holding everything."""
    from dit_train.data_pipelines.packing import step_samples
    from dit_train.tasks import build_task
    from dit_train.engine.launch import launch_local

    cfg = apply_layout(tiny_cfg, {"dp_shard": 2, "cp_ring": 2, "micro_batch_tokens": 400})
    lengths = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed).lengths()
    ids = step_samples(1, len(lengths), cfg.train.global_batch, cfg.train.seed)
    results = launch_local(_meta_worker, (cfg,), 4, cfg.launcher)
    seen = {}
    for rank, r in results.items():
        assert r["B"] == len(ids) and r["N"] == sum(lengths[i] for i in ids) and r["world"] == 4
        for sid, t in r["T"].items():
            assert t == lengths[sid], (rank, sid, t, lengths[sid])
            seen[sid] = t
    assert sorted(seen) == sorted(ids)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"dp_shard": 2, "dp_mode": "ddp"},
                                    {"dp_replicate": 2, "cp_ring": 2, "cp_fsdp_mode": "none"}])
def test_gradient_communication_does_not_grow_with_grad_accum(tiny_cfg, layout):
    from dit_train.engine.launch import launch_local
    from dit_train.parallel.mesh import ParallelDims

    from dit_train.tools.bench_collectives import count_step_collectives

    cfg = apply_layout(tiny_cfg, layout)
    world = ParallelDims.from_config(cfg.parallel).world
    names = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
    counts = launch_local(count_step_collectives, (cfg, [1, 3], names), world, cfg.launcher)[0]
    assert counts[3]["micro_batches"] > counts[1]["micro_batches"]  # really more micro-batches
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        assert counts[3][name] == counts[1][name], (layout, counts)
    assert counts[1]["reduce_scatter_single"] + counts[1]["reduce_scatter_tensor"] + counts[1]["all_reduce"] > 0


def _failing_worker(fail_rank, marker):
    import os
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == fail_rank:
        raise RuntimeError("injected failure")
    time.sleep(120)  # the survivor must be stopped by the agent, not finish on its own
    open(marker, "w").write(str(os.getpid()))  # only reached if nobody stopped it
    return os.getpid()


@pytest.mark.slow
@pytest.mark.real_launcher
def test_one_failing_worker_stops_the_others_and_reports(tmp_path):
    from dit_train.config import LauncherConfig
    from dit_train.config.errors import WorkerFailure
    from dit_train.engine.launch import launch_local

    marker = tmp_path / "survivor_finished"
    with pytest.raises(WorkerFailure, match="rank 1 failed.*injected failure"):
        launch_local(_failing_worker, (1, str(marker)), 2, LauncherConfig())
    # launch_local returned, so no worker is left; the sleeping rank was stopped, not waited for
    assert not marker.exists()


def _environment_of_worker(names):
    import os

    return {n: os.environ.get(n) for n in names}


@pytest.mark.real_launcher
def test_workers_see_the_launchers_environment_of_the_launch(monkeypatch):
    """Workers are forked from a fork server started at the first launch (engine/launch.py): an
    environment variable set, changed or removed in the launcher after that still reaches every
    worker as at the launch (as spawn gave it), beside what elastic sets for each rank."""
    from dit_train.config import LauncherConfig
    from dit_train.engine.launch import launch_local

    names = ("DIT_TRAIN_TEST_SET", "DIT_TRAIN_TEST_CHANGED", "DIT_TRAIN_TEST_REMOVED", "RANK", "WORLD_SIZE")
    monkeypatch.setenv("DIT_TRAIN_TEST_CHANGED", "before")
    monkeypatch.setenv("DIT_TRAIN_TEST_REMOVED", "before")
    launch_local(_environment_of_worker, (names,), 2, LauncherConfig())  # the fork server runs from here on
    monkeypatch.setenv("DIT_TRAIN_TEST_SET", "new")
    monkeypatch.setenv("DIT_TRAIN_TEST_CHANGED", "after")
    monkeypatch.delenv("DIT_TRAIN_TEST_REMOVED")
    seen = launch_local(_environment_of_worker, (names,), 2, LauncherConfig())
    for rank in (0, 1):
        assert seen[rank] == {"DIT_TRAIN_TEST_SET": "new", "DIT_TRAIN_TEST_CHANGED": "after",
                              "DIT_TRAIN_TEST_REMOVED": None, "RANK": str(rank), "WORLD_SIZE": "2"}, seen
