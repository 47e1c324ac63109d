"""Micro-batch planner: which (dp_shard, dp_replicate, cp_ulysses, cp_ring, ep, micro_batch_tokens,
grad_accum, activation_checkpointing, recompute_prologues) to run for a world size, a global batch
and a GPU size.

Every candidate layout of `world` ranks is checked with the same validator as training
(`dit_train.validate`) plus planner rules (no idle data-parallel rank, a micro-batch holds the
longest sample), costed with the per-rank memory model of `dit_train.perf.memory`, and ranked:

    fits in memory first, then larger micro-batch (tokens per rank), then checkpointing off,
    then the faster model.recompute_prologues setting (PROLOGUE_COST), then fewer accumulation
    steps, then less CP, then fewer expert bytes moved per step, then less expert parallelism,
    then more headroom.

`model.recompute_prologues` is planned like a memory option where it changes what a block
keeps (the DiT and LM blocks; not Wan's diffusers blocks): the setting that keeps more and
recomputes less wins unless the other fits where it does not, or holds a larger micro-batch.

Mixture-of-experts models also try every expert-parallel degree `ep` that divides both the world
and the number of experts. Memory barely tells them apart (FSDP shards the experts as finely as
EP splits them), so at equal everything above, the one moving fewer expert bytes per step wins
(`expert_comm_bytes`: FSDP's gathers and reduce-scatter of the experts against EP's all-to-alls
of the routed tokens and the replica sum) — EP for large experts and few tokens per rank.

`smoke()` runs a few real steps of the best candidates (any device; gloo on CPU) and reports
the steady-state median step time (step 0, with its lazy initialisation, is skipped) and, on
CUDA, the measured peak `torch.cuda.max_memory_allocated` against the estimate.
CLI: `python -m dit_train.tools.plan` (dit_train/tools/plan.py; `tools/plan.py` is a shim).
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from dit_train.config import PARALLEL_DEGREES, Config
from dit_train.config.errors import ConfigError
from dit_train.data_pipelines import prepare_data
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.engine.build import build_run
from dit_train.engine.checks import check_config
from dit_train.models import build_model, model_spec
from dit_train.models.lora import apply_lora, is_lora_name, lora_settings
from dit_train.parallel.mesh import ParallelDims
from dit_train.perf.memory import (DTYPE_BYTES, GIB, MemoryEstimate, ModelShape, RankSetup, estimate_memory,
                                   fsdp_shard_degree, model_shape)
from dit_train.tasks import build_task


# rank order of the AC policies at equal micro-batch: less recompute first
AC_COST = {"none": 0, "selective": 1, "full": 2}
# rank order of model.recompute_prologues at equal micro-batch and AC (None: not planned, the
# config's setting): recomputing the norms, modulate and GELU in backward costs step time
# (docs/performance.md, bench_wan's prologue_cost), so off first
PROLOGUE_COST = {None: 0, False: 0, True: 1}


@dataclass(frozen=True)
class Layout:
    """A candidate: parallel degrees plus how each rank's share is cut into micro-batches."""

    dims: ParallelDims
    micro_batch_tokens: int
    grad_accum: int
    activation_checkpointing: bool | str  # none | selective | full (bools: full / none)
    activation_offload: bool = False  # train.activation_offload
    cpu_offload: bool = False  # parallel.cpu_offload (FSDP2 CPUOffloadPolicy)
    ep: int = 1  # parallel.ep: expert-parallel degree (mixture-of-experts models)
    recompute_prologues: bool | None = None  # model.recompute_prologues; None = the config's (not planned)

    @property
    def ac(self) -> str:
        return {True: "full", False: "none"}.get(self.activation_checkpointing, self.activation_checkpointing)

    @property
    def option(self) -> str:
        """The memory option in words: AC policy and offloads."""
        return "+".join([f"ac={self.ac}"] + ["act_offload"] * self.activation_offload + ["cpu_offload"] * self.cpu_offload)

    def __getattr__(self, name: str):  # layout.dp_shard, layout.cp_ring, ... (PARALLEL_DEGREES)
        if name in PARALLEL_DEGREES:
            return getattr(self.dims, name)
        raise AttributeError(name)

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def world(self) -> int:
        return self.dims.world

    def overrides(self) -> list[str]:
        """The command-line overrides that select this layout."""
        return [f"parallel.{k}={getattr(self.dims, k)}" for k in PARALLEL_DEGREES] + [
            f"train.micro_batch_tokens={self.micro_batch_tokens}", f"train.grad_accum={self.grad_accum}",
            f"model.activation_checkpointing={self.ac}"] + ["train.activation_offload=true"] * self.activation_offload + [
            "parallel.cpu_offload=true"] * self.cpu_offload + [f"parallel.ep={self.ep}"] * (self.ep > 1) + [
            f"model.recompute_prologues={str(self.recompute_prologues).lower()}"] * (self.recompute_prologues is not None)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.dims), "micro_batch_tokens": self.micro_batch_tokens, "grad_accum": self.grad_accum,
                "activation_checkpointing": self.ac, "activation_offload": self.activation_offload,
                "cpu_offload": self.cpu_offload, "ep": self.ep, "recompute_prologues": self.recompute_prologues}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step holds: `global_batch` samples of `mean_sample_tokens` tokens on
    average, the longest having `max_sample_tokens`."""

    global_batch: int
    max_sample_tokens: int
    mean_sample_tokens: float

    @property
    def step_tokens(self) -> float:
        return self.global_batch * self.mean_sample_tokens


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    capacity: float  # bytes per rank
    smoke: dict[str, Any] = field(default_factory=dict)
    expert_comm: float = 0.0  # bytes of expert weights / routed tokens one rank moves per step

    @property
    def headroom(self) -> float:
        return self.capacity - self.memory.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def rank_key(self) -> tuple:
        """Fits first; then the larger micro-batch *per rank* (micro_batch_tokens / cp, the work
        each kernel gets), then checkpointing off, then fewer accumulation steps, then less
        context parallelism (it only adds communication at equal work), then fewer expert bytes
        moved (`expert_comm_bytes`; 0 for dense models), then less EP, then more headroom."""
        L = self.layout
        return (not self.fits, -L.micro_batch_tokens / L.cp, AC_COST[L.ac], PROLOGUE_COST[L.recompute_prologues],
                L.activation_offload, L.cpu_offload, L.grad_accum, L.cp, self.expert_comm, L.ep, -self.headroom)

    def row(self) -> dict[str, Any]:
        L = self.layout
        r = {"dp_rep": L.dp_replicate, "dp_shard": L.dp_shard, "cp_uly": L.cp_ulysses, "cp_ring": L.cp_ring, "ep": L.ep,
             "micro_tokens": L.micro_batch_tokens, "accum": L.grad_accum, "ac": L.ac,
             "prologues": {None: "-", True: "on", False: "off"}[L.recompute_prologues],
             "offload": "+".join(["act"] * L.activation_offload + ["cpu"] * L.cpu_offload) or "-",
             "state_GiB": (self.memory.params + self.memory.grads + self.memory.optimizer + self.memory.fsdp_buffers
                           + sum(self.memory.extra.values())) / GIB,
             "act_GiB": (self.memory.activations + self.memory.attention_workspace) / GIB,
             "total_GiB": self.memory.total / GIB, "headroom_GiB": self.headroom / GIB, "fits": "yes" if self.fits else "no",
             "expert_comm_GiB": self.expert_comm / GIB}
        if self.smoke:
            r["step_s"] = self.smoke.get("median_step_s", float("nan"))
            if "peak_GiB" in self.smoke:
                r["peak_GiB"] = self.smoke["peak_GiB"]
        return r

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.to_json(), "overrides": self.layout.overrides(), "fits": self.fits,
                "memory_GiB": self.memory.as_gib(), "headroom_GiB": self.headroom / GIB, "smoke": self.smoke}


# The largest world the planner plans for (2^17 ranks, beyond the largest GPU clusters): every
# split of the world into the four degrees is checked like a training config (~2 ms each), and
# their number grows with the world's divisors (1140 for 2^17; a 1e9 world ran for minutes).
MAX_PLAN_WORLD = 1 << 17


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (trial division up to sqrt(n): the cost of the answer, not of n)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def factorizations(world: int) -> list[ParallelDims]:
    """Every assignment of the parallel degrees whose product is `world`."""
    def split(n: int, k: int) -> list[tuple[int, ...]]:
        if k == 1:
            return [(n,)]
        return [(d, *rest) for d in divisors(n) for rest in split(n // d, k - 1)]

    return [ParallelDims(*degrees) for degrees in split(world, len(PARALLEL_DEGREES))]


def apply_layout(cfg: Config, layout: Layout, deep: bool = True) -> Config:
    """`cfg` with `layout`'s settings. deep=False copies only the config and the three sections
    set here and shares the rest with `cfg`: for readers that change nothing (check_layout runs
    thousands of times a plan, and deep copies of the whole config were ~45 % of its time)."""
    if deep:
        c = copy.deepcopy(cfg)
    else:
        c = copy.copy(cfg)
        c.parallel, c.train, c.model = copy.copy(cfg.parallel), copy.copy(cfg.train), copy.copy(cfg.model)
    for k in PARALLEL_DEGREES:
        setattr(c.parallel, k, getattr(layout.dims, k))
    c.train.micro_batch_tokens = layout.micro_batch_tokens
    c.train.grad_accum = layout.grad_accum
    c.model.activation_checkpointing = layout.ac
    c.train.activation_offload = layout.activation_offload
    c.parallel.cpu_offload = layout.cpu_offload
    c.parallel.ep = layout.ep
    if layout.recompute_prologues is not None:
        c.model.recompute_prologues = layout.recompute_prologues
    return c


def check_layout(cfg: Config, layout: Layout, work: Workload) -> list[str]:
    """Why `layout` cannot run (empty if it can): the training validator's errors plus the
    planner's own rules."""
    reasons = []
    try:
        check_config(apply_layout(cfg, layout, deep=False), layout.world)
    except ConfigError as err:
        reasons += err.problems
    if layout.dp > work.global_batch:
        reasons.append(f"dp_replicate·dp_shard={layout.dp} > train.global_batch={work.global_batch}: "
                       f"some data-parallel ranks would get no sample")
    if layout.micro_batch_tokens < work.max_sample_tokens:
        reasons.append(f"train.micro_batch_tokens={layout.micro_batch_tokens} < the longest sample "
                       f"({work.max_sample_tokens} tokens)")
    if layout.micro_batch_tokens < layout.cp:
        reasons.append("fewer tokens per micro-batch than CP ranks")
    return reasons


def micro_batch_options(work: Workload, dp: int, max_micro_tokens: int) -> list[tuple[int, int]]:
    """(micro_batch_tokens, grad_accum) pairs: powers of two from the longest sample up; the
    accumulation is the number of micro-batches a rank's share of the step needs."""
    per_rank = work.step_tokens / dp
    lo = max(work.max_sample_tokens, 1)
    opts = sorted({lo} | {1 << k for k in range(lo.bit_length(), max_micro_tokens.bit_length()) if (1 << k) <= max_micro_tokens})
    out = []
    for mbt in opts:
        ga = max(1, math.ceil(per_rank / mbt))
        out.append((mbt, ga))
        if ga == 1:
            break  # a larger micro-batch would only hold padding
    return out


def ep_options(shape: ModelShape, world: int) -> list[int]:
    """Expert-parallel degrees to try: 1, and for MoE models every divisor of the world size
    that also divides the number of experts."""
    if not shape.moe_blocks:
        return [1]
    return [e for e in divisors(world) if shape.experts % e == 0]


def expert_comm_bytes(s: ModelShape, layout: Layout, precision: str, *, dp_mode: str = "fsdp2",
                      cp_fsdp_mode: str = "all", reshard_after_forward: bool = True) -> float:
    """Bytes one rank sends per optimizer step for the expert layers (X expert parameters, c
    the compute dtype's size, ring-collective volumes):

    ep = 1, FSDP over S ranks: per micro-batch the experts are all-gathered in forward and again
    in backward (c·X·(S-1)/S each), once per step reduce-scattered in fp32 (4·X·(S-1)/S) and,
    over R replicas (HSDP), all-reduced (8·X/S·(R-1)/R). DDP: one all-reduce 8·X·(W-1)/W.
    ep > 1: per micro-batch and MoE layer 4 all-to-alls (2 forward, 2 backward; 6 with full
    checkpointing) of the k·L routed rows, d wide, (ep-1)/ep of them leaving the rank; once per
    step the replica sum 8·X/ep·(R-1)/R over R = world/ep ranks.
    """
    if not s.moe_blocks:
        return 0.0
    c, X, ga, W = DTYPE_BYTES[precision], s.params_experts, layout.grad_accum, layout.world
    if layout.ep > 1:
        rows = s.top_k * math.ceil(layout.micro_batch_tokens / layout.cp) * s.dim * c
        passes = 6 if layout.ac == "full" else 4
        R = W // layout.ep
        return (ga * s.moe_blocks * passes * rows * (layout.ep - 1) / layout.ep
                + 8 * X / layout.ep * (R - 1) / R)
    if W == 1:
        return 0.0
    if dp_mode != "fsdp2":
        return 8 * X * (W - 1) / W
    S = fsdp_shard_degree(layout.dp_shard, layout.cp, cp_fsdp_mode)
    R = W // S
    gathers = 2 if reshard_after_forward else 1
    return ga * gathers * c * X * (S - 1) / S + 4 * X * (S - 1) / S + 8 * X / S * (R - 1) / R


def resolve_plan_backend(cfg: Config, device: str) -> str:
    b = cfg.model.attn_backend
    if b != "auto":
        return b
    return "flash" if device == "cuda" else "sdpa"


def prologue_shapes(cfg: Config, options: tuple[bool, ...], shape: ModelShape | None = None
                    ) -> dict[bool | None, ModelShape]:
    """The model's shape under each `model.recompute_prologues` option. {None: the config's
    shape} when none is asked or the setting changes nothing the memory model counts (a model
    without prologues, e.g. Wan): then layouts leave the key alone."""
    base = shape or model_shape(cfg.model)
    if not options:
        return {None: base}
    mine = cfg.model.recompute_prologues
    other = model_shape(replace(cfg.model, recompute_prologues=not mine))
    if other.activations == base.activations:
        return {None: base}
    return {opt: base if opt == mine else other for opt in options}


def plan(cfg: Config, world: int, capacity_bytes: float, work: Workload, *, reserve_bytes: float = 0.0,
         backend: str = "flash", ac_options: tuple[bool | str, ...] = (False, True), max_micro_tokens: int = 1 << 17,
         shape: ModelShape | None = None, offload_options: tuple[tuple[bool, bool], ...] = ((False, False),),
         prologue_options: tuple[bool, ...] = ()) -> tuple[list[Candidate], list[tuple[Layout, list[str]]]]:
    """All candidates for `world` ranks, best first, and the rejected layouts with reasons.
    `shape`: the model's under the config (built on the meta device if not given);
    `prologue_options`: model.recompute_prologues settings to try (empty: the config's)."""
    shapes = prologue_shapes(cfg, prologue_options, shape)
    shape = next(iter(shapes.values()))
    p, t = cfg.parallel, cfg.train
    distill = DistillShare(cfg, shape) if cfg.distill.method != "none" else None
    # the run's settings; each layout below replaces its degrees, micro-batch and memory options
    setup = RankSetup(micro_batch_tokens=0, checkpointing=False, precision=t.precision, optimizer=cfg.optim.name,
                      momentum=cfg.optim.momentum, backend=backend, dp_mode=p.dp_mode, cp_fsdp_mode=p.cp_fsdp_mode,
                      reshard_after_forward=p.reshard_after_forward, reserve_bytes=reserve_bytes,
                      sample_tokens=work.max_sample_tokens)
    cands, rejected = [], []
    for dims in factorizations(world):
        for mbt, ga in micro_batch_options(work, dims.dp, max_micro_tokens):
            for ac, (act_off, cpu_off), ep, pro in ((a, o, e, r) for a in ac_options for o in offload_options
                                                    for e in ep_options(shape, world) for r in shapes):
                layout = Layout(dims, mbt, ga, ac, act_off, cpu_off, ep, pro)
                reasons = check_layout(cfg, layout, work)
                if reasons:
                    rejected.append((layout, reasons))
                    continue
                mem = estimate_memory(shapes[pro], replace(
                    setup, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp_ulysses=dims.cp_ulysses,
                    cp_ring=dims.cp_ring, micro_batch_tokens=mbt, checkpointing=ac, activation_offload=act_off,
                    cpu_offload=cpu_off, ep=ep))
                if distill is not None:
                    distill.add(mem)
                comm = expert_comm_bytes(shapes[pro], layout, t.precision, dp_mode=p.dp_mode,
                                         cp_fsdp_mode=p.cp_fsdp_mode, reshard_after_forward=p.reshard_after_forward)
                cands.append(Candidate(layout, mem, capacity_bytes, expert_comm=comm))
    cands.sort(key=Candidate.rank_key)
    return cands, rejected


def adapter_parameters(model_cfg: Any) -> int:
    """Parameters of one set of model.lora's adapters on the model (built on the meta device)."""
    with torch.device("meta"):
        model = apply_lora(build_model(model_cfg), lora_settings(model_cfg), model_spec(model_cfg).name)
    return sum(p.numel() for n, p in model.named_parameters() if is_lora_name(n))


class DistillShare:
    """What a distillation run (docs/distillation.md) holds beyond the student's run, sharded like
    it. Full models: the critic (weights, gradients and optimizer state, as the student's) and the
    frozen teacher (weights; in host memory with distill.teacher_offload). LoRA (model.lora): one
    base holds all three, so the only addition is the critic's adapter with its gradients and
    optimizer state (the student's own terms are counted as any run's: as full training).
    Added to the estimate in place; with parallel.cpu_offload every model's shards live on the
    host and only the student's are counted there."""

    def __init__(self, cfg: Config, shape: ModelShape):
        self.offload = cfg.distill.teacher_offload
        self.adapter_share = adapter_parameters(cfg.model) / shape.params if cfg.model.lora.rank > 0 else None

    def add(self, mem: MemoryEstimate) -> None:
        trained = mem.params + mem.grads + mem.optimizer
        if self.adapter_share is not None:
            mem.extra["distill_critic"] = trained * self.adapter_share
            return
        mem.extra["distill_critic"] = trained
        if self.offload:
            mem.host += mem.params
        else:
            mem.extra["distill_teacher"] = mem.params


def workload_from_data(cfg: Config) -> Workload:
    """Sample lengths of the configured dataset (prepares the embedded set if needed)."""
    prepare_data(cfg.data, cfg.model)
    lengths = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed).lengths()
    return Workload(cfg.train.global_batch, max(lengths), sum(lengths) / len(lengths))


# --------------------------------------------------------------------------- smoke runs


def _smoke_worker(cfg: Config, steps: int, task: Any = None) -> dict[str, Any]:
    """Run `steps` optimizer steps of `cfg`'s layout on this rank; times and peak memory."""
    run = build_run(cfg, task=task)
    cuda = run.ctx.device.type == "cuda"
    times, tokens = [], []
    for step in range(steps):
        if cuda:
            torch.cuda.synchronize()
            if step == 1:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        res = run.trainer.step(step)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(res.tokens)
    out = {"step_times_s": times, "tokens": tokens}
    if cuda:
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def smoke(cfg: Config, candidates: list[Candidate], steps: int = 4, task: Any = None) -> None:
    """Run `steps` steps of each candidate's layout (started like training: local workers, gloo
    on CPU) and store the steady-state median step time in `candidate.smoke`.
    task: train on this task instead of the configured data's (the GPU check's random latents)."""
    if steps < 2:
        raise ValueError("--smoke-steps must be >= 2 (step 0 is warm-up and not timed)")
    if task is None:
        prepare_data(cfg.data, cfg.model)
    for cand in candidates:
        c = apply_layout(cfg, cand.layout)
        c.train.steps, c.train.progress, c.train.save_weights = steps, False, False
        check_config(c, cand.layout.world)
        if cand.layout.world == 1:
            res = {0: _smoke_worker(c, steps, task)}
        else:
            res = launch.launch_local(_smoke_worker, (c, steps, task), cand.layout.world, c.launcher)
        # a step ends when the slowest rank ends: take the max over ranks, then the median over steps
        per_step = [max(r["step_times_s"][i] for r in res.values()) for i in range(steps)]
        steady = per_step[1:]
        toks = res[0]["tokens"][1:]
        cand.smoke = {"steps": steps, "median_step_s": statistics.median(steady),
                      "tokens_per_s": statistics.median(t / s for t, s in zip(toks, steady))}
        peaks = [r["peak_bytes"] for r in res.values() if "peak_bytes" in r]
        if peaks:
            est = cand.memory.total - cand.memory.reserve
            cand.smoke.update(peak_GiB=max(peaks) / GIB, estimate_GiB=est / GIB,
                              estimate_rel_error=(est - max(peaks)) / max(peaks))
