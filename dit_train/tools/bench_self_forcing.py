"""CPU time of a Self-Forcing step and of its rollout: the KV-cached rollout vs the recomputing
one (docs/causal.md, "Self-Forcing").

    python -m dit_train.tools.bench_self_forcing TEACHER_RUN [--steps 4] [--repeat 2] [overrides ...]

Builds `+experiment=self_forcing distill.teacher=TEACHER_RUN` (with the overrides, e.g.
model.causal_block_frames=2) in this process, one layout-free rank, one CPU thread, and times
with each rollout: steps 0..--steps−1 of the run (student updates at every
distill.student_every-th step, critic every step), and the student's rollout alone on step 0's
micro-batches. The figures are this process's CPU time (time.process_time: on one thread the
wall time of an idle core; other jobs on a shared machine disturb it far less than wall time),
the best of --repeat passes. The weights move between passes; the cost does not depend on them.
"""
from __future__ import annotations

import argparse
import time

import torch

from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.distill.build import build_distill_run, student_config
from dit_train.engine.layout_equivalence import apply_layout
from dit_train.parallel.mesh import init_parallel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("teacher", help="a finished bidirectional training run's folder")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    torch.set_num_threads(1)

    cfg = student_config(compose(["+experiment=self_forcing", f"distill.teacher={args.teacher}", "parallel.device=cpu",
                                  "train.progress=false", *args.overrides]))
    cfg = apply_layout(cfg, {})
    prepare_data(cfg.data, cfg.model)
    run = build_distill_run(cfg, init_parallel(cfg.parallel))
    tr = run.trainer
    rollouts = {"recomputed": tr.rollout_recomputed, "cached": tr.rollout_cached}
    micro = tr.student.prepare(tr.student.plan(0), 0, task=tr.task)
    print(f"{len(micro)} micro-batch(es) at step 0, {sum(mb.batch.num_tokens for mb in micro)} tokens, "
          f"{tr.task.max_blocks} blocks at most, {tr.task.distill.student_steps} steps per block")

    def best(fn) -> float:
        times = []
        for _ in range(args.repeat):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return min(times)

    rows = {}
    for name, rollout in rollouts.items():
        tr.generate = lambda mb, start, j, rollout=rollout: torch.no_grad()(rollout)(mb, start)  # noqa: E731
        with torch.no_grad(), tr.student.autocast():
            alone = best(lambda: [tr.generate(mb, "x", 0) for mb in micro])
        steps = best(lambda: [tr.step(s) for s in range(args.steps)]) / args.steps
        rows[name] = (alone, steps)
    print(f"| rollout | rollout at step 0 (CPU-s) | Self-Forcing step, mean of {args.steps} (CPU-s) |")
    print("|---|---|---|")
    for name, (alone, steps) in rows.items():
        print(f"| {name} | {alone:.2f} | {steps:.2f} |")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
