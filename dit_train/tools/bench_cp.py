"""Time and peak memory of a training step (forward + backward) under context parallelism, vs
pack length and clip mix: one process, cp_ulysses=2, cp_ring=2 (per-sample ring blocks) and
cp_ring=2 with the dense reference ring (`model.attn_backend=sdpa_dense`: one [L/2, L/2] score
block per ring step, what every ring step computed before the per-sample blocks).

    python -m dit_train.tools.bench_cp                              # dit_tiny, 2k-8k tokens, 3 mixes
                                                                    # (the dense reference up to 4k)
    python -m dit_train.tools.bench_cp --tokens 4096 --mix 32 --steps 3 --model dit_tiny
    python -m dit_train.tools.bench_cp --quick                      # what the tests run

All variants run in one launch of 2 local workers (gloo on the CPU), interleaved step by step
(A B C D, B C D A, ...) so that the machine's drift hits them alike; the one-process variant
runs on rank 0 while rank 1 waits at a barrier. Each step builds the pack's CP split afresh
(as the trainer does), so the ring's per-pack planning is in the time. Time: median wall
seconds of a step (the slowest rank's), and the CPU seconds of the busiest rank (robust to
other processes on the machine; gloo's waits cost none). Memory: peak bytes torch allocated during one step above what was allocated
before it (`perf.bench.peak_allocated_bytes`; the max over ranks), parameters excluded.

Mixes: `1` one clip of the whole pack; `N` N equal clips; `mixed` uneven clips (a fixed draw,
lengths 1/64 to 1/4 of the pack).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dit_train.batch import video_forward
from dit_train.compose import compose
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.engine.build import build_parallel_model
from dit_train.kernels import VarlenLayout
from dit_train.parallel.context_parallel import split_for_cp
from dit_train.parallel.mesh import init_parallel
from dit_train.perf.bench import format_table, peak_allocated_bytes, write_json
from dit_train.tools.bench_mfu import pack_of_lengths

# name -> (cp_ulysses, cp_ring, attention backend)
VARIANTS = {"1 process": (1, 1, "sdpa"), "ulysses 2": (2, 1, "sdpa"), "ring 2": (1, 2, "sdpa"),
            "ring 2 dense": (1, 2, "sdpa_dense")}
MIB = 1024 ** 2


def clip_lengths(tokens: int, mix: str) -> list[int]:
    """Clip lengths of one pack of `tokens` tokens (module docstring)."""
    if mix == "mixed":
        g = torch.Generator().manual_seed(0)
        lens: list[int] = []
        while sum(lens) < tokens:
            lens.append(min(int(tokens // 64 * (1 + 15 * float(torch.rand(1, generator=g)) ** 2)), tokens - sum(lens)))
        return lens
    n = int(mix)
    return [tokens // n] * (n - 1) + [tokens - (n - 1) * (tokens // n)]


def _cp(variant: str) -> int:
    U, R, _ = VARIANTS[variant]
    return U * R


def _config(model: str, variant: str, precision: str):
    U, R, backend = VARIANTS[variant]
    return compose([f"model={model}", f"model.attn_backend={backend}", f"parallel.cp_ulysses={U}",
                    f"parallel.cp_ring={R}", "parallel.dp_mode=none", "parallel.device=cpu",
                    f"train.precision={precision}"])


def _step(model, pack, cp: int, cp_rank: int):
    """One forward + backward of `pack` (split over `cp` ranks when cp > 1; a fresh split, so
    the ring plans it again)."""
    if cp > 1:
        local, meta = split_for_cp(pack, cp, cp_rank, "contiguous")
    else:
        local, meta = pack, VarlenLayout.build(pack.seg, pack.order, False)
    pred = video_forward(model, local, meta)
    ((pred.float() - local.tokens["target"]) ** 2).mean().backward()
    model.zero_grad(set_to_none=True)


def case_variants(variants: list[str], tokens: int, dense_up_to: int) -> list[str]:
    """The variants a pack of `tokens` runs: the dense reference only up to `dense_up_to` tokens
    (its [L/2, L/2] score blocks take minutes a step beyond a few thousand tokens here)."""
    return [n for n in variants if VARIANTS[n][2] != "sdpa_dense" or tokens <= dense_up_to]


def _worker(model_name: str, cases: list[tuple[int, str]], variants: list[str], steps: int, precision: str,
            dense_up_to: int):
    """One rank: {(tokens, mix, variant): (step seconds list, peak bytes)} (rank 1 has no
    one-process entries: it waits while rank 0 runs them)."""
    runners = {}
    # the CP variants first: they start the process group; a one-process layout then gets a
    # plain model (init_parallel leaves a group of another size alone)
    for name in sorted(variants, key=lambda n: _cp(n) == 1):
        cfg = _config(model_name, name, precision)
        ctx = init_parallel(cfg.parallel)
        runners[name] = (build_parallel_model(cfg, ctx), _cp(name), ctx.cp_rank if _cp(name) > 1 else 0)
    rank = dist.get_rank()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cpu", enabled=False)
    out: dict[tuple[int, str, str], Any] = {}
    for tokens, mix in cases:
        pack = pack_of_lengths(cfg.model, clip_lengths(tokens, mix))

        def run(name: str):
            model, cp, cp_rank = runners[name]
            if cp == 1 and rank != 0:
                return None  # the one-process variant: rank 0 alone
            with amp:
                return _step(model, pack, cp, cp_rank)

        here = case_variants(variants, tokens, dense_up_to)
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in here}
        for rep in range(steps + 1):  # rep 0: warm-up
            order = here[rep % len(here):] + here[:rep % len(here)]
            for name in order:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                run(name)
                if rep:
                    times[name].append((time.perf_counter() - t0, time.process_time() - c0))
        for name in here:
            dist.barrier()
            if _cp(name) == 1 and rank != 0:
                continue
            out[(tokens, mix, name)] = (times[name], peak_allocated_bytes(lambda: run(name)))
    return out


def bench(model: str, tokens: list[int], mixes: list[str], variants: list[str], steps: int,
          precision: str = "fp32", dense_up_to: int = 4096) -> list[dict[str, Any]]:
    """Rows of the table: one per (tokens, mix, variant), with ratios against ulysses 2 / ring 2."""
    cases = [(t, m) for t in tokens for m in mixes]
    cfg = _config(model, variants[0], precision)
    res = launch.launch_local(_worker, (model, cases, variants, steps, precision, dense_up_to), 2, cfg.launcher)
    rows = []
    for t, m in cases:
        by_name = {}
        here = case_variants(variants, t, dense_up_to)
        for name in here:
            got = [r[(t, m, name)] for r in res.values() if (t, m, name) in r]
            # the slowest rank sets the step; CPU seconds (the busiest rank's) are far less
            # sensitive than wall time to other processes on a shared machine
            step_s = max(statistics.median(w for w, _ in ts) for ts, _ in got)
            cpu_s = max(statistics.median(c for _, c in ts) for ts, _ in got)
            by_name[name] = (step_s, cpu_s, max(p for _, p in got), [[w for w, _ in ts] for ts, _ in got])
        lens = clip_lengths(t, m)
        for name in here:
            step_s, cpu_s, peak, walls = by_name[name]
            row = {"tokens": t, "clips": len(lens), "mix": m, "layout": name, "step_s": step_s, "cpu_s": cpu_s,
                   "peak_MiB": peak / MIB, "Σ T_b² / L²": sum(n * n for n in lens) / t / t}
            for ref in ("ulysses 2", "ring 2"):
                if ref in by_name and ref != name and name.startswith("ring"):
                    row[f"time / {ref}"] = step_s / by_name[ref][0]
                    row[f"cpu / {ref}"] = cpu_s / by_name[ref][1]
                    row[f"mem / {ref}"] = peak / by_name[ref][2]
            rows.append(row)
            row["wall_s_by_rank"] = walls  # every timed step (JSON only)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dit_tiny", help="a conf/model/*.yaml name")
    ap.add_argument("--tokens", default="2048,4096,8192", help="pack lengths (comma list)")
    ap.add_argument("--mix", default="1,32,mixed", help="clip mixes (comma list): 1, N equal clips, mixed")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    ap.add_argument("--dense-up-to", type=int, default=4096, help="largest pack the dense reference ring runs")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--quick", action="store_true", help="one short case (the tool's smoke test)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    tokens, mixes = [int(x) for x in a.tokens.split(",")], a.mix.split(",")
    variants = a.variants.split(",")
    if a.quick:
        tokens, mixes, a.steps = [256], ["8"], 1
    rows = bench(a.model, tokens, mixes, variants, a.steps, a.precision, a.dense_up_to)
    print(f"model {a.model}, {a.precision}, {torch.get_num_threads()} threads per process, forward + backward, "
          f"median of {a.steps} steps")
    print(format_table([{k: v for k, v in r.items() if k != "wall_s_by_rank"} for r in rows]))
    p = write_json(a.out, "cp_ring", {"args": vars(a), "rows": rows})
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
