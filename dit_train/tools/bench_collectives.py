"""Gradient collectives per optimizer step vs gradient accumulation (must not grow).

    python -m dit_train.tools.bench_collectives [overrides ...] [--grad-accum 1,2,4,8] [--layout dp_shard=2] [--out FILE]
    python -m dit_train.tools.bench_collectives model.moe.num_experts=4 --layout ep=2,dp_shard=2   # expert parallelism

Starts the layout's workers (gloo on CPU), runs one warm-up step, then counts the
torch.distributed calls made during the next optimizer step for each grad_accum. Gradient
reductions (reduce-scatter for FSDP2, all-reduce for DDP/CP sums) happen once per step, on
the last micro-batch (parameter all-gathers, per forward/backward by design, are not counted:
FSDP2 issues them outside `torch.distributed`'s module functions); the all-reduces include the per-step metadata sync,
non-finite flag and logged loss (constant). With expert parallelism the all-to-alls of the
token dispatch (per MoE layer: the per-expert row counts, rows out, rows back in forward, and
the two gradient all-to-alls in backward) run on every micro-batch by design; the expert
gradients' replica sum is one all-reduce per step. With MoE and CP, each micro-batch's expert
counts are summed within the CP group (one small all-reduce per micro-batch, like the tokens of
a sample): column `moe_count_sync`, kept out of `all_reduce`.
"""
from __future__ import annotations

import argparse

from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.engine.build import build_run
from dit_train.engine.layout_equivalence import apply_layout, parse_layout
from dit_train.parallel.mesh import init_parallel, ParallelDims
from dit_train.perf.bench import COLLECTIVES, count_collectives, format_table, write_json
import dit_train.engine.trainer as trainer_mod
import dit_train.parallel.expert_parallel as ep


def count_step_collectives(cfg, grad_accums: list[int], names=None) -> dict[int, dict[str, int]]:
    """On this rank: for each grad_accum, the torch.distributed calls of one optimizer step
    (after a warm-up step: lazy initialisation of FSDP / DDP buckets) and its micro-batches."""
    ctx = init_parallel(cfg.parallel)
    out = {}
    functional, count_sync = ep.all_to_all_single_autograd, trainer_mod.sync_expert_counts
    for ga in grad_accums:
        run = build_run(apply_layout(cfg, {"grad_accum": ga}), ctx)
        run.trainer.step(0)
        ep_calls, syncs = [0], [0]

        def counted(*a, **kw):  # the dispatch's autograd all-to-alls (functional collectives)
            ep_calls[0] += 1
            return functional(*a, **kw)

        def counted_sync(local, group):  # MoE: a sample's expert counts summed within CP
            syncs[0] += group is not None
            return count_sync(local, group)

        ep.all_to_all_single_autograd, trainer_mod.sync_expert_counts = counted, counted_sync
        try:
            with count_collectives(names or COLLECTIVES) as calls:
                res = run.trainer.step(1)
        finally:
            ep.all_to_all_single_autograd, trainer_mod.sync_expert_counts = functional, count_sync
        # the autograd all-to-all's backward is another all-to-all of the same size
        out[ga] = dict(calls, micro_batches=res.micro_batches, ep_all_to_all=2 * ep_calls[0], moe_count_sync=syncs[0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--grad-accum", default="1,2,4,8")
    ap.add_argument("--layout", action="append", default=[], help="e.g. dp_shard=2 (repeatable; default dp_shard=2 and ddp)")
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="tiny model, grad_accum 1,2, FSDP2 only")
    a = ap.parse_args(argv)
    quick = ["model.dim=32", "model.depth=2", "data.num_clips=16", "data.max_frames=8", "train.micro_batch_tokens=400"]
    cfg = compose(["train.progress=false", "train.global_batch=16", *(quick if a.quick else []), *a.overrides])
    gas = [1, 2] if a.quick else [int(x) for x in a.grad_accum.split(",")]
    layouts = a.layout or (["dp_shard=2"] if a.quick else ["dp_shard=2", "dp_shard=2,dp_mode=ddp"])
    prepare_data(cfg.data, cfg.model)
    rows = []
    for spec in layouts:
        c = apply_layout(cfg, parse_layout(spec))
        world = ParallelDims.from_config(c.parallel).world
        counts = launch.launch_local(count_step_collectives, (c, gas), world, c.launcher)[0]
        for ga in gas:
            k = counts[ga]
            rows.append({"layout": spec, "grad_accum": ga, "micro_batches": k["micro_batches"],
                         "reduce_scatter": k.get("reduce_scatter_tensor", 0) + k.get("reduce_scatter_single", 0),
                         "all_reduce": k.get("all_reduce", 0) - k["moe_count_sync"],
                         "moe_count_sync": k["moe_count_sync"],
                         "all_to_all": k.get("all_to_all_single", 0) + k.get("ep_all_to_all", 0)})
    print(format_table(rows))
    flat = all(len({(r["reduce_scatter"], r["all_reduce"]) for r in rows if r["layout"] == s}) == 1 for s in layouts)
    print(f"gradient collectives (reduce_scatter, all_reduce) per step flat in grad_accum: {'yes' if flat else 'NO'}")
    p = write_json(a.out, "collectives", {"args": vars(a), "rows": rows, "flat": flat})
    print(f"wrote {p}")
    return 0 if flat else 1


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
