"""Plan the layout of a run: which dp/cp degrees, micro-batch size, accumulation and
activation checkpointing fit a GPU, best first.

    python -m dit_train.tools.plan +experiment=video_cp8 model=dit_1b --world 8 --gpu-mem-gib 80
    python -m dit_train.tools.plan model=dit_1b train.precision=bf16 train.global_batch=64 --world 8 \\
        --max-sample-tokens 32760 --mean-sample-tokens 16000 --json plan.json
    python -m dit_train.tools.plan --from-data --world 2 --device cpu --gpu-mem-gib 4 --smoke 2   # run the top 2
    python -m dit_train.tools.plan model=dit_1b --calibrate                  # activation formula vs autograd, on CPU

Positional arguments are Hydra overrides of the training config (composed like
`python -m dit_train`); the layout keys they set are the starting point of the search only.
Memory model and formulas: dit_train/perf/memory.py. Ranking: dit_train/planner.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from dit_train.config import compose
from dit_train.parallel.mesh import ParallelDims
from dit_train.perf.bench import format_table
from dit_train.perf.memory import GIB, calibrate_block, model_shape
from dit_train.perf.planner import Workload, plan, resolve_plan_backend, smoke, workload_from_data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_train.tools.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=video_cp8 model=dit_1b")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: the config's layout)")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory per rank (default 80, an H100)")
    ap.add_argument("--reserve-gib", type=float, default=2.0,
                    help="kept free for the CUDA context, NCCL buffers and allocator fragmentation")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="target device (picks the attention backend)")
    ap.add_argument("--backend", default="", help="attention backend to cost (default: model.attn_backend, auto -> flash on cuda)")
    ap.add_argument("--max-sample-tokens", type=int, default=0, help="longest sample (default: train.micro_batch_tokens)")
    ap.add_argument("--mean-sample-tokens", type=float, default=0, help="mean sample length (default: the longest)")
    ap.add_argument("--from-data", action="store_true", help="read sample lengths from the configured dataset")
    ap.add_argument("--max-micro-tokens", type=int, default=1 << 17)
    ap.add_argument("--ac", choices=("both", "on", "off"), default="both", help="activation checkpointing options")
    ap.add_argument("--top", type=int, default=12, help="rows to print")
    ap.add_argument("--json", default="", help="write every candidate and the rejected layouts here")
    ap.add_argument("--smoke", type=int, default=0, help="run a few steps of the best K fitting candidates")
    ap.add_argument("--smoke-steps", type=int, default=4)
    ap.add_argument("--calibrate", action="store_true", help="measure one block's saved activations on CPU vs the formula")
    args = ap.parse_args(argv)

    cfg = compose(args.overrides)
    world = args.world or ParallelDims.from_config(cfg.parallel).world
    shape = model_shape(cfg.model)
    if args.from_data:
        work = workload_from_data(cfg)
    else:
        from dit_train.config.schema import AUTO_MICRO_BATCH_TOKENS

        mx = args.max_sample_tokens or cfg.train.micro_batch_tokens or AUTO_MICRO_BATCH_TOKENS
        work = Workload(cfg.train.global_batch, mx, args.mean_sample_tokens or mx)
    backend = args.backend or resolve_plan_backend(cfg, args.device)
    ac = {"both": (False, True), "on": (True,), "off": (False,)}[args.ac]
    cands, rejected = plan(cfg, world, args.gpu_mem_gib * GIB, work, reserve_bytes=args.reserve_gib * GIB,
                           backend=backend, ac_options=ac, max_micro_tokens=args.max_micro_tokens, shape=shape)

    print(f"model: {cfg.model.name} dim={shape.dim} depth={shape.depth} heads={shape.heads} "
          f"params={shape.params / 1e6:.1f}M | world={world} | {args.gpu_mem_gib:g} GiB/rank "
          f"(reserve {args.reserve_gib:g}) | precision={cfg.train.precision} optim={cfg.optim.name} attn={backend}")
    print(f"step: {work.global_batch} samples x {work.mean_sample_tokens:.0f} tokens (longest {work.max_sample_tokens})")
    calib = None
    if args.calibrate:
        calib = calibrate_block(cfg.model, tokens=256, precision="bf16" if cfg.train.precision != "fp32" else "fp32")
        print(f"calibration (one block, CPU, {calib['precision']}): measured {calib['measured_bytes_per_token_block']:.0f} "
              f"B/token, formula {calib['estimated_bytes_per_token_block']:.0f} B/token, error {calib['rel_error']:+.2%}")
    if args.smoke:
        tried = [c for c in cands if c.fits][: args.smoke]
        smoke(cfg, tried, args.smoke_steps)
        # measured beats estimated: the smoked candidates go first, fastest (tokens/s) first
        tried.sort(key=lambda c: -c.smoke["tokens_per_s"])
        cands = tried + [c for c in cands if c not in tried]
    print(format_table([dict(rank=i + 1, **c.row()) for i, c in enumerate(cands[: args.top])]))
    n_fit = sum(c.fits for c in cands)
    print(f"{len(cands)} candidates, {n_fit} fit; {len(rejected)} layouts rejected")
    if cands and cands[0].fits:
        how = f" (fastest of the {args.smoke} measured)" if args.smoke else ""
        print(f"best{how}: " + " ".join(cands[0].layout.overrides()))
    else:
        print("nothing fits: raise --gpu-mem-gib, the world size, or lower the longest sample")
    # one line per distinct (parallel degrees, reason): micro-batch and AC options repeat them
    seen = dict.fromkeys((layout.dims, reason) for layout, reasons in rejected for reason in reasons)
    for dims, reason in list(seen)[:5]:
        print(f"  rejected {dims.describe()}: {reason}")
    if len(seen) > 5:
        print(f"  ... {len(seen) - 5} more rejections (--json lists them all)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "world": world, "gpu_mem_gib": args.gpu_mem_gib, "backend": backend, "workload": work.__dict__,
            "model": dataclasses.asdict(shape), "calibration": calib, "candidates": [c.to_json() for c in cands],
            "rejected": [{"layout": lay.to_json(), "reasons": r} for lay, r in rejected]}, indent=2))
        print(f"wrote {args.json}")
    return 0 if cands and cands[0].fits else 1


if __name__ == "__main__":
    sys.exit(main())
