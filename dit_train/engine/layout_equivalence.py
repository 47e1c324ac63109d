"""Layout equivalence: train the same steps on several layouts, compare with one process.

Used by `python -m dit_train.tools.verify_layouts` (users prove their config exact before a long run) and by
the tests. The measure is the largest weight difference relative to the size of the update:

    rel = max_i |w_i(layout) - w_i(1 proc)| / max_i |w_i(1 proc) - w_i(init)|

so "1e-4" means the layouts disagree by 0.01% of how far training moved the weights. With
EMA on (train.ema_decay > 0) the EMA weights are compared the same way (relative to how far
the EMA moved), and the larger of the two ratios is reported.
"""
from __future__ import annotations

import copy
import functools
import typing
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from dit_train.config import TRAIN_LAYOUT_KEYS, Config, ParallelConfig, TrainConfig, parallel_layout_keys
from dit_train.models.quant import dequantized
from dit_train.engine.build import build_run
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.parallel.mesh import ParallelDims, init_parallel
from dit_train.sharded import is_dtensor

EMA_PREFIX = "__ema__/"  # EMA weights in train_weights' results
PARALLEL_KEYS = set(parallel_layout_keys()) - {"device", "threads_per_worker"}
TRAIN_KEYS = set(TRAIN_LAYOUT_KEYS)


def parse_layout(spec: str) -> dict[str, Any]:
    """'dp_shard=2,cp_ulysses=2,grad_accum=2' -> {key: value} (typed by the schema). '1' or '' =
    one process."""
    types = typing.get_type_hints(ParallelConfig) | typing.get_type_hints(TrainConfig)
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item == "1":
            continue
        key, _, value = item.partition("=")
        if key not in PARALLEL_KEYS | TRAIN_KEYS:
            raise ValueError(f"unknown layout key {key!r} in {spec!r}; use {sorted(PARALLEL_KEYS | TRAIN_KEYS)}")
        kind = types[key]
        try:
            out[key] = value.lower() == "true" if kind is bool else kind(value)
        except ValueError as err:
            raise ValueError(f"layout {spec!r}: {key}={value!r} is not a valid {getattr(kind, '__name__', kind)}") from err
    return out


def apply_layout(cfg: Config, layout: dict[str, Any], reduction: str | None = None) -> Config:
    cfg = copy.deepcopy(cfg)
    for k, v in layout.items():
        setattr(cfg.parallel if k in PARALLEL_KEYS else cfg.train, k, v)
    if reduction is not None:
        cfg.loss = replace(cfg.loss, reduction=reduction)
    return cfg


def train_weights(cfgs: list[Config]) -> list[dict[str, torch.Tensor]]:
    """Train each config for cfg.train.steps; full final weights on rank 0.

    The configs may have different layouts of the same world size (each gets its own device
    mesh inside the current process group). Returns a list aligned with cfgs holding
    {"__init__/<name>": ..., "<name>": ..., "__grad_norms__": ...} on rank 0 and empty dicts
    elsewhere.
    """
    results = []
    meshes: dict[str, Any] = {}
    for cfg in cfgs:
        key = repr(cfg.parallel)
        ctx = meshes[key] = meshes.get(key) or init_parallel(cfg.parallel)
        run = build_run(cfg, ctx)
        init = local_pieces(sharded_state_dict(run.model), "__init__/")
        norms = [run.trainer.step(s).grad_norm for s in range(cfg.train.steps)]
        final = local_pieces(sharded_state_dict(run.model))
        ema = local_pieces(run.ema.shadow, EMA_PREFIX) if run.ema is not None else []
        out = gather_pieces(init + final + ema, ctx)
        if ctx.is_main:
            out["__grad_norms__"] = torch.tensor(norms, dtype=torch.float64)
        results.append(out)
    return results


def sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict as `full_state_dict` keys it (wrapper prefixes removed), each value
    this rank's part: a DTensor under FSDP2 / expert parallelism, the whole tensor otherwise."""
    # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start of a tool that imports this)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))


Piece = tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]  # name, full shape, offset, this rank's part


def local_pieces(named: dict[str, Any], prefix: str = "") -> list[Piece]:
    """fp32 CPU copies of this rank's parts of `named`'s tensors and where each sits in the full
    tensor (no collective: a snapshot, e.g. the weights before step 0)."""
    out = []
    for name, t in named.items():
        if is_dtensor(t):
            # FSDP2 never shards a quantized base (quantized_parameters are its ignored params). The
            # local part is taken before anything else: each op on the DTensor itself (detach
            # included) goes through DTensor's dispatch, ~0.3 ms a call, three snapshots of every
            # parameter per layout run.
            offset = _local_offset(tuple(t.shape), t.device_mesh, tuple(t.placements))
            with torch.no_grad():
                local = t.to_local()
        else:
            t = dequantized(t.detach())  # a quantized base (model.base_quant): its values, as the model computes with them
            local, offset = t, (0,) * t.dim()
        out.append((prefix + name, tuple(t.shape), offset, local.to("cpu", torch.float32, copy=True).contiguous()))
    return out


@functools.lru_cache(maxsize=1024)
def _local_offset(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> tuple[int, ...]:
    """Where this rank's part of a DTensor of `shape` sits in the full tensor. Cached: the
    parameters of a model share a few (shape, placement) pairs, and the snapshots of a run ask
    for each parameter three times (initial, final, EMA)."""
    # deferred: torch.distributed.tensor is loaded already when `t` is a DTensor; one process never is
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[1])


def gather_pieces(pieces: list[Piece], ctx: Any) -> dict[str, torch.Tensor]:
    """The full tensors on rank 0 ({} elsewhere), from every rank's pieces in one collective.

    `full_state_dict` (the run's export) gathers parameter by parameter, each a DTensor
    redistribution: for the tiny models of the layout tests that was ~40 % of a worker's CPU
    time, three times per run (initial, final and EMA weights). Here each rank sends its parts
    once; rank 0 writes each where it belongs and checks that every element was written. Parts
    held by several ranks (replicas) are written by rank 0 last, so its copy is the one kept, as
    in `full_state_dict`."""
    if ctx.distributed and dist.get_world_size() > 1:
        everyone: list[Any] | None = [None] * dist.get_world_size() if ctx.is_main else None
        # as numpy arrays: a pickled torch tensor goes through torch.serialization, ~10x slower
        dist.gather_object([(n, s, o, t.numpy()) for n, s, o, t in pieces], everyone, dst=0)
        if everyone is not None:
            everyone = [[(n, s, o, torch.from_numpy(a)) for n, s, o, a in got] for got in everyone]
    else:
        everyone = [pieces]
    if not ctx.is_main:
        return {}
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for rank_pieces in reversed(everyone):
        for name, shape, offset, local in rank_pieces:
            if name not in full:
                full[name] = torch.empty(shape, dtype=torch.float32)
                seen[name] = torch.zeros(shape, dtype=torch.bool)
            where = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            full[name][where] = local
            seen[name][where] = True
    missing = [name for name, s in seen.items() if not bool(s.all())]
    assert not missing, f"no rank holds part of {missing[:5]}"
    return full


def relative_difference(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """max |other − ref| / max |ref − init| over the weights, and the same for the EMA weights
    when both results hold them (the larger ratio)."""
    worst = 0.0
    for prefix in ("", EMA_PREFIX):
        names = [k for k in ref if k.startswith(prefix) and not k[len(prefix):].startswith("__")]
        theirs = {k for k in other if k.startswith(prefix) and not k[len(prefix):].startswith("__")}
        if prefix and not names and not theirs:
            continue
        missing = set(names) ^ theirs
        if missing:
            raise AssertionError(f"weight names differ between layouts: {sorted(missing)[:5]}")
        diff = max(float((other[k] - ref[k]).abs().max()) for k in names)
        update = max(float((ref[k] - ref[f"__init__/{k[len(prefix):]}"]).abs().max()) for k in names)
        worst = max(worst, diff / max(update, 1e-30))
    return worst


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


def world_of(cfg: Config) -> int:
    return ParallelDims.from_config(cfg.parallel).world


def train_on_workers(cfgs: list[Config]) -> list[dict[str, torch.Tensor]]:
    """`train_weights(cfgs)` with one local launch per world size (spawning workers costs more
    than a tiny run: layouts of the same size share their workers). Results in cfgs' order."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in cfgs]
    for world in sorted({world_of(c) for c in cfgs}):
        idx = [i for i, c in enumerate(cfgs) if world_of(c) == world]
        group = [cfgs[i] for i in idx]
        res = train_weights(group) if world == 1 else launch.launch_local(train_weights, (group,), world, group[0].launcher)[0]
        for i, r in zip(idx, res):
            out[i] = r
    return out


def run_layout(cfg: Config, layout: dict[str, Any], reductions: list[str]) -> list[dict[str, torch.Tensor]]:
    """Train every reduction on one layout (local workers if it needs more than one process)."""
    return train_on_workers([apply_layout(cfg, layout, r) for r in reductions])


def run_layouts(cfg: Config, layouts: list[str], reductions: list[str]) -> dict[str, list[dict[str, torch.Tensor]]]:
    """{layout spec: [results per reduction]} for every layout, in one launch per world size."""
    cfgs = [apply_layout(cfg, parse_layout(spec), r) for spec in layouts for r in reductions]
    flat = train_on_workers(cfgs)
    n = len(reductions)
    return {spec: flat[i * n:(i + 1) * n] for i, spec in enumerate(layouts)}


def verify_layouts(cfg: Config, layouts: list[str], reductions: list[str], tol: float = 1e-4) -> list[LayoutResult]:
    """Compare every layout with the one-process oracle, for every reduction."""
    got = run_layouts(cfg, ["1", *layouts], reductions)
    oracle = got.pop("1")
    results = []
    for spec, per_reduction in got.items():
        world = world_of(apply_layout(cfg, parse_layout(spec)))
        for r, ref, other in zip(reductions, oracle, per_reduction):
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
