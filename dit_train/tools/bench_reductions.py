"""Step-time overhead of the exact loss reductions (sample_mean, token_mean) vs naive_mean.

    python -m dit_train.tools.bench_reductions [overrides ...] [--reps 30] [--out FILE] [--quick]

One process, the real Trainer step (plan, packing, metadata sync, forward, per-token loss,
reduction weights, backward, clip, optimizer) on the configured model and data (default: the
tiny video DiT on the embedded clips). The reduction is the only thing that changes between
variants; repetitions are interleaved (A B C, B C A, ...) on the same step indices so machine
drift hits all alike. Reports the median step time per reduction and its ratio to naive_mean,
in wall time and in CPU time of the process (robust to other processes on a shared machine),
plus the isolated loss-path time (token_weights + weighted_loss per micro-batch, and the
metadata sync) as a fraction of the step.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


import torch

from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.engine.build import build_run
from dit_train.loss import token_weights, weighted_loss
from dit_train.perf.bench import format_table, interleaved_wall_and_cpu, median, write_json

REDUCTIONS = ("naive_mean", "sample_mean", "token_mean")


def build_trainer(overrides: list[str]):
    cfg = compose(overrides)
    cfg.train.steps = 10 ** 6  # a constant LR schedule over the repetitions
    prepare_data(cfg.data, cfg.model)
    return cfg, build_run(cfg).trainer


def loss_path_seconds(trainer, reduction: str, step: int, reps: int) -> dict[str, float]:
    """Median seconds per step of the reduction's own work, isolated from the model."""
    micro = trainer.prepare(trainer.plan(step), step)
    per_token = [torch.randn(m.batch.seg.shape[0], requires_grad=True) for m in micro]
    sync, path = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        counts = trainer.sync_counts(micro)
        t1 = time.perf_counter()
        total = 0
        for k, m in enumerate(micro):
            total = total + weighted_loss(per_token[k], token_weights(reduction, m.batch.seg, m.batch.valid, counts, k))
        total.backward()
        t2 = time.perf_counter()
        sync.append(t1 - t0)
        path.append(t2 - t1)
    return {"metadata_sync_s": median(sync), "weights_and_loss_s": median(path)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (default: the tiny video DiT config)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4, help="distinct step indices cycled through")
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.reps, a.steps = 3, 2
    cfg, trainer = build_trainer(["train.progress=false", *a.overrides])
    counter = {"i": 0}

    def variant(red: str):
        def run():
            trainer.loss_cfg.reduction = red
            trainer.step(counter["i"] // len(REDUCTIONS) % a.steps)
            counter["i"] += 1
        return run

    wall, cpu = interleaved_wall_and_cpu({r: variant(r) for r in REDUCTIONS}, reps=a.reps, warmup=1)
    both = {"wall": wall, "cpu": cpu}
    times = both["wall"]
    base = median(times["naive_mean"])
    cbase = median(both["cpu"]["naive_mean"])
    rows = []
    for r in REDUCTIONS:
        iso = loss_path_seconds(trainer, r, 0, max(5, a.reps))
        m = median(times[r])
        cm = median(both["cpu"][r])
        rows.append({"reduction": r, "median_step_ms": m * 1e3, "ratio_vs_naive": m / base,
                     "cpu_ms": cm * 1e3, "cpu_ratio": cm / cbase,
                     "p25_ms": float(torch.tensor(times[r]).quantile(0.25)) * 1e3,
                     "p75_ms": float(torch.tensor(times[r]).quantile(0.75)) * 1e3,
                     "loss_path_ms": iso["weights_and_loss_s"] * 1e3, "meta_sync_ms": iso["metadata_sync_s"] * 1e3,
                     "loss_path_pct_of_step": 100 * (iso["weights_and_loss_s"] + iso["metadata_sync_s"]) / m})
    print(f"model {cfg.model.name} dim={cfg.model.dim} depth={cfg.model.depth}, global_batch={cfg.train.global_batch}, "
          f"micro_batch_tokens={cfg.train.micro_batch_tokens}, {a.reps} interleaved reps, threads={torch.get_num_threads()}")
    print(format_table(rows))
    worst = max(r["cpu_ratio"] for r in rows)
    iso_worst = max(r["loss_path_pct_of_step"] for r in rows)
    print(f"largest CPU-time ratio vs naive_mean: {worst:.4f}; largest isolated loss-path share: {iso_worst:.3f}% "
          f"(target overhead <= 1%)")
    p = write_json(a.out, "reductions", {"args": vars(a), "rows": rows, "raw_times_s": both})
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
