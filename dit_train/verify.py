"""Layout equivalence: train the same steps on several layouts, compare with one process.

Used by `tools/verify_layouts.py` (users prove their config exact before a long run) and by
the tests. The measure is the largest weight difference relative to the size of the update:

    rel = max_i |w_i(layout) - w_i(1 proc)| / max_i |w_i(1 proc) - w_i(init)|

so "1e-4" means the layouts disagree by 0.01% of how far training moved the weights.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from dit_train.checkpoint import full_state_dict
from dit_train.config import Config
from dit_train.data import build_task
from dit_train.optim import build_optimizer, build_scheduler
from dit_train.parallel.mesh import ParallelDims, init_parallel
from dit_train.train import build_parallel_model, set_threads
from dit_train.trainer import Trainer

PARALLEL_KEYS = {"dp_replicate", "dp_shard", "cp_ulysses", "cp_ring", "dp_mode", "cp_fsdp_mode", "meta_init",
                 "fsdp_prefetch"}
TRAIN_KEYS = {"grad_accum", "micro_batch_tokens"}


def parse_layout(spec: str) -> dict[str, Any]:
    """'dp_shard=2,cp_ulysses=2,grad_accum=2' -> {key: value}. '1' or '' = one process."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item == "1":
            continue
        key, _, value = item.partition("=")
        if key not in PARALLEL_KEYS | TRAIN_KEYS:
            raise ValueError(f"unknown layout key {key!r} in {spec!r}; use {sorted(PARALLEL_KEYS | TRAIN_KEYS)}")
        out[key] = value if key in ("dp_mode", "cp_fsdp_mode") else (value.lower() == "true" if key == "meta_init" else int(value))
    return out


def apply_layout(cfg: Config, layout: dict[str, Any], reduction: str | None = None) -> Config:
    cfg = copy.deepcopy(cfg)
    for k, v in layout.items():
        setattr(cfg.parallel if k in PARALLEL_KEYS else cfg.train, k, v)
    if reduction is not None:
        cfg.loss = replace(cfg.loss, reduction=reduction)
    return cfg


def train_weights(cfgs: list[Config]) -> list[dict[str, torch.Tensor]]:
    """Train each config (same layout) for cfg.train.steps; full final weights on rank 0.

    Returns a list aligned with cfgs holding {"__init__/<name>": ..., "<name>": ...} on rank 0
    and empty dicts elsewhere. Runs inside the current process group.
    """
    ctx = init_parallel(cfgs[0].parallel)
    set_threads(cfgs[0].parallel.threads_per_worker, ctx.dims.world)
    results = []
    for cfg in cfgs:
        task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
        model = build_parallel_model(cfg, ctx)
        init = full_state_dict(model)
        opt = build_optimizer(model, cfg.optim)
        trainer = Trainer(model, task, opt, build_scheduler(opt, cfg.optim, cfg.train.steps), ctx,
                          cfg.train, cfg.optim, cfg.loss, cfg.parallel)
        norms = [trainer.step(s).grad_norm for s in range(cfg.train.steps)]
        final = full_state_dict(model)
        out = {f"__init__/{k}": v for k, v in init.items()} | final if ctx.is_main else {}
        if ctx.is_main:
            out["__grad_norms__"] = torch.tensor(norms, dtype=torch.float64)
        results.append(out)
    return results


def relative_difference(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    names = [k for k in ref if not k.startswith("__")]
    missing = set(names) ^ {k for k in other if not k.startswith("__")}
    if missing:
        raise AssertionError(f"weight names differ between layouts: {sorted(missing)[:5]}")
    diff = max(float((other[k] - ref[k]).abs().max()) for k in names)
    update = max(float((ref[k] - ref[f"__init__/{k}"]).abs().max()) for k in names)
    return diff / max(update, 1e-30)


@dataclass
class LayoutResult:
    layout: str
    reduction: str
    world: int
    rel_diff: float
    tol: float

    @property
    def passed(self) -> bool:
        return self.rel_diff <= self.tol


def run_layout(cfg: Config, layout: dict[str, Any], reductions: list[str]) -> list[dict[str, torch.Tensor]]:
    """Train every reduction on one layout (local workers if it needs more than one process)."""
    from dit_train.launch import launch_local

    cfgs = [apply_layout(cfg, layout, r) for r in reductions]
    world = ParallelDims.from_config(cfgs[0].parallel).world
    if world == 1:
        return train_weights(cfgs)
    return launch_local(train_weights, (cfgs,), world, cfg.launcher)[0]


def verify_layouts(cfg: Config, layouts: list[str], reductions: list[str], tol: float = 1e-4,
                   progress: bool = True) -> list[LayoutResult]:
    """Compare every layout with the one-process oracle, for every reduction."""
    from tqdm.auto import tqdm

    oracle = run_layout(cfg, {}, reductions)
    results = []
    for spec in tqdm(layouts, desc="layouts", disable=not progress):
        layout = parse_layout(spec)
        world = ParallelDims.from_config(apply_layout(cfg, layout).parallel).world
        got = run_layout(cfg, layout, reductions)
        for r, ref, other in zip(reductions, oracle, got):
            results.append(LayoutResult(spec or "1", r, world, relative_difference(ref, other), tol))
    return results


def format_table(results: list[LayoutResult]) -> str:
    """Markdown table. naive_mean rows read 'biased' when they differ (the expected outcome)."""
    width = max([44] + [len(r.layout) for r in results])
    rows = [f"| {'layout':<{width}} | world | {'reduction':<11} | max rel. diff | result |",
            f"|{'-' * (width + 2)}|-------|-------------|---------------|--------|"]
    for r in results:
        if r.reduction == "naive_mean":
            verdict = "same" if r.passed else "biased"
        else:
            verdict = "PASS" if r.passed else "FAIL"
        rows.append(f"| {r.layout:<{width}} | {r.world:>5} | {r.reduction:<11} | {r.rel_diff:>13.2e} | {verdict:<6} |")
    return "\n".join(rows)
