"""Prove a config layout-exact before a long run.

Trains a few steps of your config on one process and on each listed layout (local gloo/NCCL
workers), then prints: layout, reduction, max relative weight difference vs one process,
PASS/FAIL (tolerance 1e-4 of the update).

    python -m dit_train.tools.verify_layouts                                   # default layouts, tiny run
    python -m dit_train.tools.verify_layouts --layouts "dp_shard=2;cp_ulysses=2,cp_ring=2" \
        --reductions sample_mean,token_mean -- model=dit_tiny train.global_batch=8

Everything after `--` (or any bare key=value) is a Hydra override of the training config, e.g.
`python -m dit_train.tools.verify_layouts model.moe.num_experts=4` for a mixture-of-experts run.

By default the comparison runs with plain SGD (your learning rate and clipping kept): the
check is about gradients, and Adam's update g/(sqrt(v)+eps) turns fp32 reduction-order noise on
near-zero gradients (|g| ~ eps) into update differences of ~1e-3 of the step, which hides real
bugs among false alarms. `--optimizer config` keeps your optimizer.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.engine.checks import Range
from dit_train.engine.layout_equivalence import format_table, parse_layout, verify_layouts
from dit_train.tasks import check_data, resolve_config
from dit_train.tools.args import POSITIVE_INT, ToolParser, ranged


DEFAULT_LAYOUTS = ("dp_shard=2;dp_replicate=2,dp_shard=2;dp_shard=2,dp_mode=ddp;cp_ulysses=2;cp_ring=2;"
                   "cp_ulysses=2,cp_ring=2;dp_shard=2,cp_ulysses=2,grad_accum=2")
# added to the defaults when the model has an even number of experts (model.moe.num_experts)
EP_LAYOUTS = "ep=2,dp_shard=2;ep=2,dp_shard=2,cp_ulysses=2,grad_accum=2"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    ap = ToolParser(prog="python -m dit_train.tools.verify_layouts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="", help="';'-separated layouts, each 'key=value,...' (default: "
                    "FSDP2, HSDP, DDP, Ulysses, ring, both CP, with accumulation; expert parallelism with MoE)")
    ap.add_argument("--reductions", default="sample_mean,token_mean,naive_mean")
    ap.add_argument("--steps", type=POSITIVE_INT, default=3)
    ap.add_argument("--tol", type=ranged(float, Range(0)), default=1e-4)
    ap.add_argument("--optimizer", choices=["sgd", "config"], default="sgd",
                    help="sgd (default): compare gradients through plain SGD; config: your optimizer")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (key=value), also accepted after `--`")
    args = ap.parse_args(argv)
    overrides = [*args.overrides, *overrides]

    cfg = compose([f"train.steps={args.steps}", "train.progress=false", *overrides])
    if args.optimizer == "sgd":
        cfg.optim.name, cfg.optim.momentum, cfg.optim.weight_decay = "sgd", 0.0, 0.0
    chosen = args.layouts or DEFAULT_LAYOUTS
    if not args.layouts and cfg.model.moe.num_experts and cfg.model.moe.num_experts % 2 == 0:
        chosen += ";" + EP_LAYOUTS
    layouts = [s.strip() for s in chosen.split(";") if s.strip()]
    for spec in layouts:
        parse_layout(spec)  # fail on a typo before anything runs
    prepare_data(cfg.data, cfg.model)
    cfg = resolve_config(cfg, check_data(cfg))
    results = verify_layouts(cfg, layouts, args.reductions.split(","), tol=args.tol)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ | {"passed": r.passed} for r in results], indent=2))
    failed = [r for r in results if r.reduction != "naive_mean" and not r.passed]
    print(f"\n{len(results) - len(failed)}/{len(results)} rows as expected"
          + (f"; {len(failed)} FAILED" if failed else " (naive_mean rows show the bias of per-rank averaging)"))
    return 1 if failed else 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
