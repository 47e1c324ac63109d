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

from dit_train.checkpoint import export_weights, load_checkpoint, resolve_checkpoint, save_checkpoint
from dit_train.config import Config
from dit_train.data import build_task
from dit_train.metrics import MetricsLogger
from dit_train.models import build_model, initialize
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
        initialize(model, cfg.model, cfg.train.seed)
        return model
    model = build_model(cfg.model, backend)
    initialize(model, cfg.model, cfg.train.seed)
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


def build_sampler(cfg: Config, task: Any, ctx: ParallelContext):
    """Validation-video sampler; rank 0 alone decodes latents (it alone writes videos)."""
    from dit_train.sampling import ValidationSampler

    decode = None
    if cfg.data.name == "latent_cache" and ctx.is_main:
        from data_pipelines.latent_cache import load_decoder

        decode = load_decoder(cfg.data.root, ctx.device)
    return ValidationSampler(task, ctx, cfg.train.num_samples, cfg.train.sample_steps, cfg.train.guidance_scale,
                             cfg.train.seed, decode)


def resume_spec(cfg: Config) -> str:
    """train.resume, except that a worker restarted by the elastic agent (after a failure,
    launcher.max_restarts > 0) always continues from the newest checkpoint of its run."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not cfg.train.resume:
        return "auto"
    return cfg.train.resume


def run(cfg: Config, ctx: ParallelContext | None = None) -> dict[str, Any]:
    """Train for cfg.train.steps; returns a summary. Creates the process group if needed."""
    ctx = ctx or init_parallel(cfg.parallel)
    set_threads(cfg.parallel.threads_per_worker, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    run_dir = Path(shared_run_dir(cfg.run_dir, ctx))
    cfg.run_dir = str(run_dir)
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)

    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    heldout = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, split="heldout") \
        if cfg.train.eval_every > 0 else None
    model = build_parallel_model(cfg, ctx)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    trainer = Trainer(model, task, optimizer, scheduler, ctx, cfg.train, cfg.optim, cfg.loss, cfg.parallel)

    start = 0
    ckpt = resolve_checkpoint(resume_spec(cfg), run_dir)
    if ckpt is not None:
        meta = load_checkpoint(ckpt, model, optimizer, scheduler)
        trainer.load_state_dict(meta.get("trainer", {}))
        start = int(meta["step"]) + 1

    sampler = build_sampler(cfg, task, ctx) if cfg.train.sample_every > 0 else None
    logger = MetricsLogger(run_dir, cfg.train.steps, start, enabled=ctx.is_main,
                           progress=cfg.train.progress, log_every=cfg.train.log_every)
    if ckpt is not None:
        logger.write(f"resumed from {ckpt} at step {start}")
    last = None
    every = cfg.train.ckpt_every
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
                "skipped": int(res.skipped), "skipped_total": trainer.skipped_total,
            }
            if res.dropped:
                record["samples_dropped"] = res.dropped
            if trainer.loss_scale is not None:
                record["loss_scale"] = trainer.loss_scale.scale
            if heldout is not None and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
                record.update(trainer.evaluate(heldout))
            logger.log(record)
            if sampler is not None and (step + 1) % cfg.train.sample_every == 0:
                clips = sampler.sample(model, trainer._autocast)
                if ctx.is_main:
                    out = sampler.write(clips, run_dir / "samples" / f"step_{step + 1:06d}", logger.tensorboard, step)
                    logger.write(f"validation videos: {out}")
            if trainer.skipped_in_a_row > cfg.train.max_skipped_steps:
                raise NonFiniteTraining(
                    f"{trainer.skipped_in_a_row} steps in a row had non-finite gradients or losses "
                    f"(train.max_skipped_steps={cfg.train.max_skipped_steps}); lower optim.lr, enable clipping "
                    f"(optim.max_grad_norm), use train.precision=bf16 instead of fp16, or check the data")
            if every > 0 and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
                save_checkpoint(run_dir, step, model, optimizer, scheduler, trainer.state_dict(), config_yaml,
                                cfg.train.keep_last)
        if cfg.train.save_weights:
            export_weights(model, run_dir / "weights.safetensors", ctx.is_main)
    finally:
        logger.close()
    summary = {"steps": cfg.train.steps, "final_loss": last.loss if last else None,
               "skipped_steps": trainer.skipped_total, "resumed_from": str(ckpt) if ckpt else None}
    if ctx.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class NonFiniteTraining(RuntimeError):
    """Too many consecutive steps with non-finite gradients."""
