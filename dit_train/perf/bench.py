"""Small helpers shared by the planner and the `tools/bench_*.py` scripts: interleaved timing,
collective counting, tables and JSON results."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def interleaved_times(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1,
                      clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Time each callable `reps` times, round-robin (A B C A B C ...), so that slow drift of the
    machine (other processes, thermal state) hits every variant alike. Returns seconds of
    `clock`: wall time by default; `time.process_time` (CPU seconds of this process, all
    threads) is far less sensitive to other processes on a shared machine."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        # rotate the start so no variant always runs right after the same other one
        keys = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for k in keys:
            t0 = clock()
            fns[k]()
            times[k].append(clock() - t0)
    return times


def interleaved_wall_and_cpu(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1
                             ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """`interleaved_times` recording both wall seconds and CPU seconds of this process."""
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}

    def timed(k: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(time.perf_counter() - w0)
            cpu[k].append(time.process_time() - c0)
        return run

    interleaved_times({k: timed(k, fn) for k, fn in fns.items()}, reps=reps, warmup=warmup)
    for d in (wall, cpu):  # drop the warm-up calls
        for k in d:
            d[k] = d[k][warmup:]
    return wall, cpu


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes that torch allocated on the CPU while `fn` ran, above what was allocated
    before it (torch keeps no peak statistic for the CPU, as it does for CUDA): the running sum
    of the profiler's allocation and free records. Profiling slows `fn`: time it separately."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in records:
        now += nbytes
        peak = max(peak, now)
    return peak


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Markdown table (readable in a terminal and pasteable into the README)."""
    if not rows:
        return "(no rows)"
    if columns is None:  # union of keys, in first-seen order (rows may add columns)
        columns = list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v or abs(v) < 1000:
                return f"{v:.4g}"
            return f"{v:.0f}" if abs(v) < 1e9 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def environment() -> dict[str, Any]:
    """Where and when a result was measured: versions, threads, the date (UTC) and the load
    average (1, 5, 15 minutes) when it was written — on a shared machine, read timings with it."""
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}


def dumps_records(payload: dict[str, Any]) -> str:
    """`payload` as JSON with one line per top-level key and one line per element of a
    top-level list (a candidate, a rejected layout, an option): a plan of 240 candidates is
    ~250 lines, not ~9,000 (indent=2 spreads each candidate over ~40), and a diff shows which
    record changed."""
    parts = []
    for k, v in payload.items():
        if isinstance(v, list) and v:
            rows = ",\n".join("    " + json.dumps(x) for x in v)
            parts.append(f"  {json.dumps(k)}: [\n{rows}\n  ]")
        else:
            parts.append(f"  {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_json(path: str | Path | None, name: str, payload: dict[str, Any]) -> Path:
    """Write `payload` (+ environment) to `path`, default benchmarks/results/<name>.json."""
    p = Path(path) if path else RESULTS_DIR / f"{name}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"benchmark": name, "env": environment(), **payload}, indent=2))
    return p


COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
               "all_gather", "all_to_all_single", "broadcast")


@contextmanager
def count_collectives(names: Sequence[str] = COLLECTIVES) -> Iterator[dict[str, int]]:
    """Count calls of torch.distributed collectives made through the `torch.distributed`
    module (FSDP2, DDP's hooks and our metadata sync all call them there)."""
    calls = {n: 0 for n in names if hasattr(dist, n)}
    originals = {n: getattr(dist, n) for n in calls}

    def wrap(name: str):
        def f(*a, **kw):
            calls[name] += 1
            return originals[name](*a, **kw)
        return f

    for n in calls:
        setattr(dist, n, wrap(n))
    try:
        yield calls
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def add_packed_vs_diffusers_args(ap: Any) -> None:
    """The flags the packed-vs-diffusers benchmarks share (bench_wan, bench_wan22, bench_families):
    the model shape both sides get, our attention backend, repetitions, threads, the JSON out,
    --quick (the tool's smoke test)."""
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--text-dim", type=int, default=256)
    ap.add_argument("--backend", default="sdpa", help="our attention backend (sdpa | flex | sdpa_dense)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true")


def parse_packed_vs_diffusers_args(ap: Any, argv: list[str] | None, quick: tuple[int, int, int, int]) -> Any:
    """`ap` parsed (add_packed_vs_diffusers_args' flags and the tool's own); --quick sets the
    shape to `quick` (dim, depth, heads, text_dim) and one repetition; --threads is applied."""
    a = ap.parse_args(argv)
    if a.quick:
        (a.dim, a.depth, a.heads, a.text_dim), a.reps = quick, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    return a


def packed_vs_diffusers_header(a: Any) -> str:
    """The line above a packed-vs-diffusers table: precision, threads, repetitions, the shape."""
    return (f"fp32, {torch.get_num_threads()} threads, {a.reps} reps; dim {a.dim}, depth {a.depth}, heads {a.heads}, "
            f"text_dim {a.text_dim}, our attention {a.backend}")


def padded_batch(clips: Sequence[torch.Tensor]) -> torch.Tensor:
    """Clips [C, F_i, H_i, W_i] as one batch [B, C, F, H, W] zero-padded to the largest (F, H, W):
    what a transformer without a self-attention mask runs for clips of different sizes."""
    F, H, W = (max(c.shape[i] for c in clips) for i in (1, 2, 3))
    x = clips[0].new_zeros(len(clips), clips[0].shape[0], F, H, W)
    for i, c in enumerate(clips):
        x[i, :, :c.shape[1], :c.shape[2], :c.shape[3]] = c
    return x
