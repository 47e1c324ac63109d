"""The worker: what every rank runs, whoever started it (our launcher, torchrun or SLURM)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from dit_train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from dit_train.checkpoint.export import export_run_weights, initial_weights
from dit_train.checkpoint.parts import JSONState
from dit_train.config import Config, to_dict, to_yaml
from dit_train.config.errors import ConfigError, DataFailure, LossDiverged, NonFiniteTraining, RunFailed, RunFolderError
from dit_train.engine.build import Run, build_run
from dit_train.engine.launch import check_interrupted
from dit_train.engine.resume import apply_optimizer_settings
from dit_train.engine.run_folder import open_run_folder, run_id_of
from dit_train.engine.sanity import (Divergence, nonfinite_hint, nonfinite_weights, zero_gradient_warning,
                                     zero_head_error)
from dit_train.engine.summary import write_summary
from dit_train.engine.validation import Validation, format_scores
from dit_train.metrics import MetricsLogger
from dit_train.parallel.mesh import ParallelContext, init_parallel
from dit_train.trackers import TrackedRun, open_trackers, records_config

log = logging.getLogger(__name__)


def shared_run_dir(run_dir: str, ctx: ParallelContext) -> str:
    """Rank 0's run dir for everyone. Under torchrun every rank composed its own Hydra config,
    and a time-stamped default dir can differ by a second between ranks."""
    if not ctx.distributed:
        return run_dir

    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    if box[0] != run_dir:
        log.warning("rank %d: using rank 0's run dir %s (pass hydra.run.dir=... under torchrun)", ctx.rank, box[0])
    return box[0]


def resume_spec(cfg: Config) -> str:
    """train.resume, except that a worker restarted by the elastic agent (after a failure,
    launcher.max_restarts > 0) always continues from the newest checkpoint of its run."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return "auto"
    return cfg.train.resume


def claim_run_folder(cfg: Config, ctx: ParallelContext, claimed: bool, hydra_record: Any = None,
                     data: Any = None) -> str:
    """The checkpoint to resume from ("" = none). When no launching process claimed the run
    folder (direct calls, torchrun, SLURM), rank 0 claims it here (run_folder.py; `hydra_record`
    and `data` as there) and every rank learns the outcome: the same resume point, or the same error."""
    restarting = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if claimed or restarting:
        return resume_spec(cfg)
    outcome: list[Any] = [None]
    if ctx.is_main:
        try:
            folder = open_run_folder(cfg, cfg.train.resume, hydra_record, data)
            _HELD.append(folder)  # its lock is held as long as this process runs
            outcome = [("ok", str(folder.resume_from or ""))]
        except RunFolderError as err:
            outcome = [("error", str(err))]
    if ctx.distributed:
        dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise RunFolderError(value)
    return value


_HELD: list[Any] = []


class DataHealth:
    """Unreadable samples over the run. A step whose global batch has no readable sample stops
    the run at once; more than data.max_dropped_fraction of the samples read (judged from 100
    samples on, and at the end) fails it. Messages name examples (this rank's)."""

    def __init__(self, max_fraction: float, task: Any):
        self.max_fraction, self.task = max_fraction, task
        self.seen = self.dropped = 0

    def examples(self) -> str:
        reasons = getattr(self.task, "failure_reasons", {})
        shown = list(reasons.values())[:3]
        return ("e.g. " + "; ".join(shown)) if shown else "see the warnings above"

    def check(self, step: int, samples: int, dropped: int, final: bool = False) -> None:
        self.seen += samples + dropped
        self.dropped += dropped
        if samples == 0 and dropped > 0:
            raise DataFailure(f"step {step}: none of the {dropped} samples of the global batch could be read "
                              f"({self.examples()}); check the data (data.root) and its decoding")
        share = self.dropped / max(1, self.seen)
        if share > self.max_fraction and (self.seen >= 100 or final):
            raise DataFailure(f"{self.dropped} of the {self.seen} samples read so far could not be decoded "
                              f"({share:.0%} > data.max_dropped_fraction={self.max_fraction}; {self.examples()}); "
                              f"fix or remove those files, or raise data.max_dropped_fraction")


def train(cfg: Config, ctx: ParallelContext | None = None, claimed: bool = False, hydra_record: Any = None,
          data: Any = None, build: Callable[..., Run] = build_run) -> dict[str, Any]:
    """Train for cfg.train.steps; returns a summary. Creates the process group if needed.

    claimed: the launching process already claimed the run folder (`open_run_folder`) and
    resolved `cfg.train.resume`; otherwise rank 0 does it here (with `hydra_record` and `data`,
    see `open_run_folder`). build: what builds the run's models, task and trainer (`build_run`;
    the entry point passes DMD2's three-model `build_distill_run` for distill.method=dmd2)."""
    ctx = ctx or init_parallel(cfg.parallel)
    run_dir = Path(shared_run_dir(cfg.run_dir, ctx))
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))  # torchrun: rank 0's folder (a copy: cfg is only read)
    resume = claim_run_folder(cfg, ctx, claimed, hydra_record, data)
    # only rank 0 writes it, into checkpoints: OmegaConf's structured copy of the whole tree costs
    # ~0.07 CPU-s, more than a tiny run's steps on the other ranks
    config_yaml = to_yaml(cfg) if ctx.is_main and cfg.train.ckpt_every > 0 else ""
    run = build(cfg, ctx, heldout=cfg.train.eval_every > 0)
    trainer, t = run.trainer, cfg.train
    divergence = Divergence(t.divergence_factor, cfg.loss.reduction)
    # its reference step rides in trainer.json: a resumed launch judges against the run's first step
    parts = {**run.checkpoint_parts(), "divergence": JSONState(divergence, optional=True)}
    start = 0
    ckpt = resolve_checkpoint(resume, run_dir)
    if ckpt is not None:
        start = load_checkpoint(ckpt, parts) + 1
        apply_optimizer_settings(run.optimizer, run.scheduler, cfg.optim)
    cannot_learn = zero_head_error(run.model, cfg.model.lora.rank, ctx.device, ctx.world_group)
    if cannot_learn:
        raise ConfigError(cannot_learn)
    run_id = run_id_of(run_dir) or ""

    validation = Validation(cfg, run) if t.sample_every > 0 else None
    if validation is not None and validation.reference:
        (run_dir / "samples").mkdir(parents=True, exist_ok=True)
        (run_dir / "samples" / "reference.json").write_text(json.dumps(validation.reference, indent=2))
    trackers: list = []
    if ctx.is_main:  # the config as data only for a tracker that records it (W&B; not TensorBoard)
        config = to_dict(cfg) if records_config(t.loggers) else {}
        trackers = open_trackers(t, TrackedRun(run_dir, run_id, start, config))
    logger = MetricsLogger(run_dir, t.steps, start, enabled=ctx.is_main, progress=t.progress, log_every=t.log_every,
                           trackers=trackers)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts:
        logger.write(f"restart {restarts} of launcher.max_restarts={cfg.launcher.max_restarts} after a worker failure")
    logger.write(f"run folder: {run_dir}" + (f" (resumed from {ckpt} at step {start})" if ckpt is not None else ""))
    if validation is not None:
        logger.write(validation.describe())
    if validation is not None and validation.reference:
        logger.write(f"quality of the real validation clips (the reference): {format_scores(validation.reference)}")
    health = DataHealth(cfg.data.max_dropped_fraction, run.task)
    last, error, done = None, None, start
    try:
        for step in range(start, t.steps):
            check_interrupted()  # a signal whose exception a finalizer swallowed still stops the run here
            t0 = time.perf_counter()
            res = trainer.step(step)
            dt = time.perf_counter() - t0
            if step == 0 and (warning := zero_gradient_warning(res.grad_norm, res.skipped, cfg.model.lora.rank)):
                log.warning(warning)
            record = {
                "step": step, "loss": res.loss, "grad_norm": res.grad_norm,
                # float(): torchao's optimizers keep the LR as a 0-d tensor
                "lr": float(run.scheduler.get_last_lr()[0]), "tokens": res.tokens, "samples": res.samples,
                "micro_batches": res.micro_batches, "step_time_s": dt, "tokens_per_s": res.tokens / max(dt, 1e-9),
                "skipped": int(res.skipped), "skipped_total": trainer.skipped_total,
            }
            if res.dropped:
                record["samples_dropped"] = res.dropped
            record.update(res.extras)
            if trainer.loss_scale is not None:
                record["loss_scale"] = trainer.loss_scale.scale
            health.check(step, res.samples, res.dropped, final=step + 1 == t.steps)
            if run.heldout is not None and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                record.update(trainer.heldout_loss(run.heldout))
            if validation is not None and ((step + 1) % t.sample_every == 0 or step + 1 == t.steps):
                out, scores = validation(run_dir, step, logger)
                record.update(scores)
                if out is not None:
                    logger.write(f"validation videos ({'EMA' if run.ema else 'training'} weights): {out}"
                                 + (f"  {format_scores(scores)}" if scores else ""))
            logger.log(record)
            if trainer.skipped_in_a_row > t.max_skipped_steps:
                raise NonFiniteTraining(
                    f"{trainer.skipped_in_a_row} steps in a row had non-finite gradients or losses "
                    f"(train.max_skipped_steps={t.max_skipped_steps}); {nonfinite_hint(cfg.optim, t)}")
            # a skipped step with non-finite weights can never recover: every later step is skipped
            if res.skipped and nonfinite_weights(run.model, ctx.device, ctx.world_group):
                raise NonFiniteTraining(f"step {step}: the weights are no longer finite (an earlier update made them "
                                        f"NaN or inf); {nonfinite_hint(cfg.optim, t)}")
            # before this step's checkpoint: the diverged weights are not kept, the earlier checkpoints are
            if diverged := divergence.update(step, res.loss, res.tokens, res.samples, last=step + 1 == t.steps):
                raise LossDiverged(f"{diverged}; {nonfinite_hint(cfg.optim, t)} (train.divergence_factor=0 turns "
                                   f"this check off)")
            if t.ckpt_every > 0 and ((step + 1) % t.ckpt_every == 0 or step + 1 == t.steps):
                path = save_checkpoint(run_dir, step, parts, config_yaml, t.keep_last, run_id)
                logger.write(f"checkpoint of step {step}: {path}")
            last, done = res, step + 1
        if last is not None and not math.isfinite(last.loss):
            raise NonFiniteTraining(f"the last step's loss is {last.loss} (not finite); {nonfinite_hint(cfg.optim, t)}")
        if done > start and nonfinite_weights(run.model, ctx.device, ctx.world_group):
            raise NonFiniteTraining(f"the weights after step {done - 1} are not finite; {nonfinite_hint(cfg.optim, t)}")
        if t.save_weights:
            try:
                # a quantized or swapped base is not in the model as full tensors: merge into the one it started from
                partial = str(cfg.model.base_quant) != "none" or cfg.model.block_swap > 0
                export_run_weights(run.model, run.ema, cfg.model, run_dir, ctx.is_main,
                                   base=(lambda: initial_weights(cfg)) if partial else None)
            except OSError as err:  # a full disk at the very end: one line, and where the weights still are
                raise RunFailed(f"the final weights could not be written into {run_dir} ({err.strerror or err}); "
                                f"the run's checkpoints (train.ckpt_every) still hold them: free space, then "
                                f"python -m dit_train.tools.export_weights {run_dir}") from None
    except BaseException as err:
        error = err
        raise
    finally:
        # final_loss: the loss of the last step done (null when this launch did none)
        summary = {"status": run_status(error), "steps": t.steps, "steps_done": done,
                   "final_loss": last.loss if last else None, "skipped_steps": trainer.skipped_total,
                   "samples_dropped": health.dropped, "resumed_from": str(ckpt) if ckpt else None}
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
        if ctx.is_main:
            write_summary(run_dir, summary)
        logger.write(ending_line(error, run_dir, done))
        logger.close(ok=error is None)
    return summary


def run_status(error: BaseException | None) -> str:
    if error is None:
        return "completed"
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"


def ending_line(error: BaseException | None, run_dir: Path, done: int) -> str:
    """The run's last console line. A worker whose group the elastic agent will restart
    (launcher.max_restarts) says so instead of FAILED: training goes on."""
    if error is None:
        return f"finished: {run_dir}"
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts < most and not isinstance(error, KeyboardInterrupt):
        return (f"stopped after step {done - 1} ({type(error).__name__}): restarting every worker from the newest "
                f"checkpoint (restart {restarts + 1} of launcher.max_restarts={most})")
    return f"{run_status(error).upper()}: {run_dir}"
