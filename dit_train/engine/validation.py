"""Validation videos and their scores: a component beside the trainer, built and called by the worker."""
from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

from dit_train.config import Config
from dit_train.data_pipelines import source_for
from dit_train.engine.build import Run
from dit_train.sampling import run_sampling, scored_view, source_requests, to_pixels, VideoSampler, write_samples
from dit_train.sampling.sound import sound_info, sound_scores
from dit_train.sampling.conditioned import condition_on_clips, control_on_clips, given_scores, i2v_on_clips, validation_task


class Validation:
    """Validation videos of a video run: the same `train.num_samples` dataset clips every time
    (all ranks sample; rank 0 decodes, scores and writes samples/step_XXXXXX/)."""

    def __init__(self, cfg: Config, run: Run):
        t = cfg.train
        task = validation_task(cfg, run.task)  # conditioned runs: held-out clips when there are
        self.source = source_for(cfg.data, cfg.model)
        requests = source_requests(task, self.source, t.num_samples)
        if cfg.cond.active:  # conditioned: from the clips' own first frames (tasks/conditioning.py)
            condition_on_clips(requests, [task.dataset[r.noise_id].pixels for r in requests], cfg.cond, task.patch[0])
        if task.control:  # cond.control: each clip's own control video
            control_on_clips(requests, task)
        if task.inputs.i2v_mask:  # Wan 2.1 I2V: each clip's cached condition latents and image tokens
            i2v_on_clips(requests, task)
        null = task.null_caption() if task.text_dim else None
        # the training shift: validation samples from the noise levels the model was trained on
        self.sampler = VideoSampler(requests, task.inputs, null, run.ctx, t.sample_steps, t.guidance_scale, t.seed,
                                    sound=self.source.sound(run.ctx.device), **run_sampling(cfg))
        # rank 0 alone decodes (it alone writes): latents with the source's decoder, pixels as they are
        self.decode = self.source.decoder(run.ctx.device) if run.ctx.is_main else None
        self.latent = self.source.latent
        self.run, self.guidance, self.steps = run, t.guidance_scale, t.sample_steps
        self.reference: dict[str, float] = {}
        if run.ctx.is_main and not self.source.latent:
            # the same figures on the real clips: what a perfect generator would score
            real = scored_view(requests, [task.dataset[r.noise_id].pixels for r in requests])
            self.reference = self.source.score(real, [r.caption for r in requests]) or {}
            self.reference |= given_scores(self.source, requests, real, task.patch[0])
        self.held_out = task is not run.task

    def describe(self) -> str:
        """One line: how many training clips validation samples, at which sizes (the sizes they
        train at: data.resolution_buckets, or native; latent caches: the latent grid)."""
        unit = "latent frames x height x width" if self.latent else "frames x height x width"
        sizes = Counter("x".join(str(n) for n in r.shape[1:]) for r in self.sampler.requests)
        listed = ", ".join(size + (f" ({k} clips)" if k > 1 else "") for size, k in sizes.most_common())
        which = "held-out" if self.held_out else "training"
        given = sum(r.given is not None for r in self.sampler.requests)
        cond = f", {given} from their own first frames (cond.kind)" if given else ""
        cond += ", with their control videos (cond.control)" if self.sampler.control else ""
        return (f"validation samples {len(self.sampler.requests)} {which} clip(s) with their captions{cond}, at the "
                f"sizes they train at ({unit}): {listed}")

    def __call__(self, run_dir: Path, step: int, trackers: Any = None) -> tuple[Path | None, dict[str, float]]:
        """Sample (from the EMA weights when EMA is on); rank 0 writes and hands the grid and clips
        to the trackers. Returns (folder, eval figures)."""
        run = self.run
        swap = run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext()
        with swap:
            clips = self.sampler.sample(run.model, run.trainer.autocast)
        if not run.ctx.is_main:
            return None, {}
        pixels = to_pixels(clips, self.decode)
        requests = self.sampler.requests
        scores = self.source.score(scored_view(requests, pixels), [r.caption for r in requests]) or {}
        scores |= given_scores(self.source, requests, pixels, self.sampler.patch[0])
        if scores:  # a source with a metric (the shapes world): the generated sound's figures too
            scores |= sound_scores([r.caption for r in requests], pixels, self.sampler.sounds)
        info = {"step": step + 1, "weights": "ema" if run.ema is not None else "training",
                "sample_steps": self.steps, "guidance_scale": self.guidance,
                "stochastic_sampling": self.sampler.stochastic, "shifts": self.sampler.shifts,
                "scores": scores, **sound_info(self.sampler.sounds)}
        out = write_samples(run_dir / "samples" / f"step_{step + 1:06d}", self.sampler.requests, pixels, info, trackers,
                            step, sounds=self.sampler.sounds)
        return out, scores


def format_scores(scores: dict[str, float]) -> str:
    keys = ("palette_share", "background_ok", "color_ok", "shape_ok", "motion_ok", "all_ok", "kept_ok", "motion_after_ok",
            "sound_color_ok", "sound_sync_ok")
    return " ".join(f"{k}={scores[f'eval/{k}']:.2f}" for k in keys if f"eval/{k}" in scores)
