"""The worker: what every rank runs, whoever started it (our launcher, torchrun or SLURM)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from dit_train.checkpoint import export_weights
from dit_train.config import Config
from dit_train.data import build_task
from dit_train.metrics import MetricsLogger
from dit_train.models import build_model, init_weights
from dit_train.optim import build_optimizer, build_scheduler
from dit_train.parallel.mesh import ParallelContext, init_parallel
from dit_train.parallel.parallelize import parallelize
from dit_train.trainer import Trainer
from kernels import resolve_backend

log = logging.getLogger(__name__)


def set_threads(threads_per_worker: int, local_world: int) -> None:
    if threads_per_worker > 0:
        torch.set_num_threads(threads_per_worker)
    elif local_world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def build_parallel_model(cfg: Config, ctx: ParallelContext) -> torch.nn.Module:
    """Plain model -> initialised -> parallelized. Initial weights depend only on train.seed."""
    backend = resolve_backend(cfg.model.attn_backend, ctx.device)
    if cfg.parallel.meta_init:
        with torch.device("meta"):
            model = build_model(cfg.model, backend)
        model = parallelize(model, ctx, cfg.parallel, cfg.model, cfg.train, backend)
        model.to_empty(device=ctx.device)
        init_weights(model, cfg.train.seed, cfg.model.init)
        return model
    model = build_model(cfg.model, backend)
    init_weights(model, cfg.train.seed, cfg.model.init)
    model.to(ctx.device)
    return parallelize(model, ctx, cfg.parallel, cfg.model, cfg.train, backend)


def shared_run_dir(run_dir: str, ctx: ParallelContext) -> str:
    """Rank 0's run dir for everyone. Under torchrun every rank composed its own Hydra config,
    and a time-stamped default dir can differ by a second between ranks."""
    if not ctx.distributed:
        return run_dir
    import torch.distributed as dist

    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    if box[0] != run_dir:
        log.warning("rank %d: using rank 0's run dir %s (pass hydra.run.dir=... under torchrun)", ctx.rank, box[0])
    return box[0]


def write_resolved_config(cfg: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def run(cfg: Config, ctx: ParallelContext | None = None) -> dict[str, Any]:
    """Train for cfg.train.steps; returns a summary. Creates the process group if needed."""
    ctx = ctx or init_parallel(cfg.parallel)
    set_threads(cfg.parallel.threads_per_worker, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    run_dir = Path(shared_run_dir(cfg.run_dir, ctx))
    if ctx.is_main:
        cfg.run_dir = str(run_dir)
        write_resolved_config(cfg, run_dir)

    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    heldout = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, split="heldout") \
        if cfg.train.eval_every > 0 else None
    model = build_parallel_model(cfg, ctx)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    trainer = Trainer(model, task, optimizer, scheduler, ctx, cfg.train, cfg.optim, cfg.loss, cfg.parallel)

    start = 0
    logger = MetricsLogger(run_dir, cfg.train.steps, start, enabled=ctx.is_main,
                           progress=cfg.train.progress, log_every=cfg.train.log_every)
    last = None
    try:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            res = trainer.step(step)
            dt = time.perf_counter() - t0
            last = res
            record = {
                "step": step, "loss": res.loss, "grad_norm": res.grad_norm,
                "lr": scheduler.get_last_lr()[0], "tokens": res.tokens, "samples": res.samples,
                "micro_batches": res.micro_batches, "step_time_s": dt, "tokens_per_s": res.tokens / max(dt, 1e-9),
                "skipped": int(res.skipped),
            }
            if heldout is not None and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
                record.update(trainer.evaluate(heldout))
            logger.log(record)
            if trainer.skipped_in_a_row > cfg.train.max_skipped_steps:
                raise RuntimeError(f"{trainer.skipped_in_a_row} steps in a row had non-finite gradients "
                                   f"(train.max_skipped_steps={cfg.train.max_skipped_steps}); lower optim.lr or "
                                   f"check the data")
        if cfg.train.save_weights:
            export_weights(model, run_dir / "weights.safetensors", ctx.is_main)
    finally:
        logger.close()
    summary = {"steps": cfg.train.steps, "final_loss": last.loss if last else None, "skipped_steps": trainer.skipped_total}
    if ctx.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
