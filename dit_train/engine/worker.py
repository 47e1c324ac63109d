"""The worker: what every rank runs, whoever started it (our launcher, torchrun or SLURM)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from dit_train.checkpoint import export_weights, load_checkpoint, resolve_checkpoint, save_checkpoint, save_safetensors
from dit_train.config import Config, to_yaml
from dit_train.engine.build import Run, build_run
from dit_train.metrics import MetricsLogger
from dit_train.parallel.mesh import ParallelContext, init_parallel

log = logging.getLogger(__name__)


class NonFiniteTraining(RuntimeError):
    """Too many consecutive steps with non-finite gradients."""


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


class Validation:
    """Validation videos of a video run: the same `train.num_samples` dataset clips every time
    (all ranks sample; rank 0 decodes, scores and writes samples/step_XXXXXX/)."""

    def __init__(self, cfg: Config, run: Run):
        from dit_train.data import source_for
        from dit_train.sampling import VideoSampler, dataset_requests

        t, task = cfg.train, run.task
        self.source = source_for(cfg.data, cfg.model)
        inner = getattr(task.dataset, "dataset", task.dataset)  # through the background prefetcher
        requests = dataset_requests(task, t.num_samples, lambda i: self.source.fps(inner, i))
        null = task.null_caption() if task.text_dim else None
        self.sampler = VideoSampler(requests, task.patch, task.text_dim, null, run.ctx, t.sample_steps,
                                    t.guidance_scale, t.seed, prediction=task.prediction, x0_min_t=task.x0_min_t)
        self.decode = None
        if cfg.data.name == "latent_cache" and run.ctx.is_main:  # rank 0 alone decodes (it alone writes)
            from data_pipelines.latent_cache import load_decoder

            self.decode = load_decoder(cfg.data.root, run.ctx.device)
        self.run, self.guidance, self.steps = run, t.guidance_scale, t.sample_steps

    def __call__(self, run_dir: Path, step: int, tb: Any = None) -> tuple[Path | None, dict[str, float]]:
        """Sample (from the EMA weights when EMA is on); rank 0 writes. Returns (folder, eval figures)."""
        import contextlib

        from dit_train.sampling import to_pixels, write_samples

        run = self.run
        swap = run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext()
        with swap:
            clips = self.sampler.sample(run.model, run.trainer.autocast)
        if not run.ctx.is_main:
            return None, {}
        pixels = to_pixels(clips, self.decode)
        scores = self.source.score(pixels, [r.caption for r in self.sampler.requests]) or {}
        info = {"step": step + 1, "weights": "ema" if run.ema is not None else "training",
                "sample_steps": self.steps, "guidance_scale": self.guidance, "scores": scores}
        out = write_samples(run_dir / "samples" / f"step_{step + 1:06d}", self.sampler.requests, pixels, info, tb, step)
        return out, scores


def format_scores(scores: dict[str, float]) -> str:
    keys = ("palette_share", "background_ok", "color_ok", "shape_ok", "motion_ok", "all_ok")
    return " ".join(f"{k}={scores[f'eval/{k}']:.2f}" for k in keys if f"eval/{k}" in scores)


def resume_spec(cfg: Config) -> str:
    """train.resume, except that a worker restarted by the elastic agent (after a failure,
    launcher.max_restarts > 0) always continues from the newest checkpoint of its run."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not cfg.train.resume:
        return "auto"
    return cfg.train.resume


def train(cfg: Config, ctx: ParallelContext | None = None) -> dict[str, Any]:
    """Train for cfg.train.steps; returns a summary. Creates the process group if needed."""
    ctx = ctx or init_parallel(cfg.parallel)
    run_dir = Path(shared_run_dir(cfg.run_dir, ctx))
    cfg.run_dir = str(run_dir)
    config_yaml = to_yaml(cfg)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)

    run = build_run(cfg, ctx, heldout=cfg.train.eval_every > 0)
    trainer, t = run.trainer, cfg.train
    parts = run.checkpoint_parts()
    start = 0
    ckpt = resolve_checkpoint(resume_spec(cfg), run_dir)
    if ckpt is not None:
        start = load_checkpoint(ckpt, parts) + 1

    validation = Validation(cfg, run) if t.sample_every > 0 else None
    logger = MetricsLogger(run_dir, t.steps, start, enabled=ctx.is_main, progress=t.progress, log_every=t.log_every)
    if ckpt is not None:
        logger.write(f"resumed from {ckpt} at step {start}")
    last = None
    try:
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            res = trainer.step(step)
            dt = time.perf_counter() - t0
            last = res
            record = {
                "step": step, "loss": res.loss, "grad_norm": res.grad_norm,
                "lr": run.scheduler.get_last_lr()[0], "tokens": res.tokens, "samples": res.samples,
                "micro_batches": res.micro_batches, "step_time_s": dt, "tokens_per_s": res.tokens / max(dt, 1e-9),
                "skipped": int(res.skipped), "skipped_total": trainer.skipped_total,
            }
            if res.dropped:
                record["samples_dropped"] = res.dropped
            if trainer.loss_scale is not None:
                record["loss_scale"] = trainer.loss_scale.scale
            if run.heldout is not None and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                record.update(trainer.heldout_loss(run.heldout))
            if validation is not None and ((step + 1) % t.sample_every == 0 or step + 1 == t.steps):
                out, scores = validation(run_dir, step, logger.tensorboard)
                record.update(scores)
                if out is not None:
                    logger.write(f"validation videos ({'EMA' if run.ema else 'training'} weights): {out}"
                                 + (f"  {format_scores(scores)}" if scores else ""))
            logger.log(record)
            if trainer.skipped_in_a_row > t.max_skipped_steps:
                raise NonFiniteTraining(
                    f"{trainer.skipped_in_a_row} steps in a row had non-finite gradients or losses "
                    f"(train.max_skipped_steps={t.max_skipped_steps}); lower optim.lr, enable clipping "
                    f"(optim.max_grad_norm), use train.precision=bf16 instead of fp16, or check the data")
            if t.ckpt_every > 0 and ((step + 1) % t.ckpt_every == 0 or step + 1 == t.steps):
                save_checkpoint(run_dir, step, parts, config_yaml, t.keep_last)
        if t.save_weights:
            export_weights(run.model, run_dir / "weights.safetensors", ctx.is_main)
            if run.ema is not None:
                ema = run.ema.full_state_dict()  # every rank: a collective under FSDP
                if ctx.is_main:
                    save_safetensors(ema, run_dir / "weights_ema.safetensors")
    finally:
        logger.close()
    summary = {"steps": t.steps, "final_loss": last.loss if last else None,
               "skipped_steps": trainer.skipped_total, "resumed_from": str(ckpt) if ckpt else None}
    if ctx.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
