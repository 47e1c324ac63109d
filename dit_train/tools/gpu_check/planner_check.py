"""Planner accuracy: `tools.plan`'s memory estimate of a layout against the peak a few real
training steps of it reach (`planning.planner.smoke`, on random latents of Wan 480p sizes)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from dit_train.compose import compose
from dit_train.kernels import resolve_backend
from dit_train.perf.memory import GIB
from dit_train.planning.planner import Workload, plan, smoke
from dit_train.tools.gpu_check.synthetic import latent_task


def planner_accuracy(device: torch.device, configs: Sequence[tuple[list[str], str]],
                     grids: Sequence[tuple[int, int, int]], steps: int, time_left: Callable[[], float],
                     capacity_gib: float, reserve_gib: float = 2.0) -> list[dict[str, Any]]:
    """For each (overrides, activation checkpointing policy): the planner's best fitting world-1
    layout for clips of patch grids `grids` (one step = all of them), then `steps` steps of it;
    the estimate (without the reserve) against torch.cuda.max_memory_allocated after step 0."""
    rows = []
    for overrides, ac in configs:
        label = " ".join(overrides) + f" ac={ac}"
        if time_left() < 45:
            rows.append({"config": label, "skipped": "time budget"})
            continue
        cfg = compose([*overrides, f"parallel.device={device.type}", f"train.global_batch={len(grids)}",
                       "train.ema_decay=0", "train.progress=false"])
        task = latent_task(cfg, grids)
        lengths = task.lengths()
        work = Workload(cfg.train.global_batch, max(lengths), sum(lengths) / len(lengths))
        backend = resolve_backend(cfg.model.attn_backend, device)  # what the run will use, not what a GPU might have
        cands, _ = plan(cfg, 1, capacity_gib * GIB, work, reserve_bytes=reserve_gib * GIB, backend=backend,
                        ac_options=(ac,), max_micro_tokens=max(lengths) * 2)
        fitting = [c for c in cands if c.fits][:1]
        if not fitting:
            rows.append({"config": label, "skipped": f"no world-1 layout fits {capacity_gib:.0f} GiB"})
            continue
        smoke(cfg, fitting, steps, task=task)
        c = fitting[0]
        row = {"config": label, "micro_tokens": c.layout.micro_batch_tokens, "accum": c.layout.grad_accum,
               "backend": backend, "step_s": c.smoke["median_step_s"], "tokens_per_s": c.smoke["tokens_per_s"]}
        if "peak_GiB" in c.smoke:
            row.update(estimate_GiB=c.smoke["estimate_GiB"], peak_GiB=c.smoke["peak_GiB"],
                       estimate_rel_error=c.smoke["estimate_rel_error"],
                       pass_10pct=abs(c.smoke["estimate_rel_error"]) <= 0.10)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
