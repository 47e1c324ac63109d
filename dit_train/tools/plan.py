"""Plan the layout of a run: which dp/cp degrees, micro-batch size, accumulation, activation
checkpointing and recomputed prologues fit a GPU, best first.

    python -m dit_train.tools.plan +experiment=video_cp8 model=dit_1b --world 8 --gpu-mem-gib 80
    python -m dit_train.tools.plan model=dit_1b train.precision=bf16 train.global_batch=64 --world 8 \\
        --max-sample-tokens 32760 --mean-sample-tokens 16000 --json plan.json
    python -m dit_train.tools.plan --from-data --world 2 --device cpu --gpu-mem-gib 4 --smoke 2   # run the top 2
    python -m dit_train.tools.plan model=dit_1b --calibrate                  # activation formula vs autograd, on CPU
    python -m dit_train.tools.plan model=wan_14b train.precision=bf16 --world 8 --frames 81 --height 720 --width 1280
        # "how many frames fit": per AC policy x offload option, the best layout for the clip and the
        # longest clip of that size that fits (dit_train/planning/clips.py); add --smoke 1 on GPUs to measure
    python -m dit_train.tools.plan model=wan_14b model.lora.rank=32 train.precision=bf16 --gpu-mem-gib 24 \
        --frames 81 --height 512 --width 512    # LoRA on one card: base_quant, block_swap, AC (planning/one_gpu.py)

Positional arguments are Hydra overrides of the training config (composed like
`python -m dit_train`); the layout keys they set are the starting point of the search only.
Memory model and formulas: dit_train/perf/memory.py. Ranking: dit_train/planning/planner.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from dit_train.compose import compose
from dit_train.config import PARALLEL_DEGREES
from dit_train.config.schema import AUTO_MICRO_BATCH_TOKENS
from dit_train.engine.checks import Range
from dit_train.models import model_spec
from dit_train.parallel.mesh import ParallelDims
from dit_train.perf.bench import dumps_records, format_table
from dit_train.planning.clips import clip_options, clip_tokens, latent_grid
from dit_train.perf.memory import GIB, calibrate_block, model_shape
from dit_train.planning import one_gpu
from dit_train.planning.planner import (MAX_PLAN_WORLD, Workload, adapter_parameters, plan, resolve_plan_backend, smoke,
                                        workload_from_data)
from dit_train.tools.args import POSITIVE_FLOAT, POSITIVE_INT, ToolParser, ranged


def vae_stride(text: str) -> tuple[int, ...]:
    """An argparse `type=` for --vae-stride: "t,h,w", three integers >= 1 ("" = the model's)."""
    if not text:
        return ()
    try:
        stride = tuple(int(x) for x in text.split(","))
    except ValueError:
        stride = ()
    if len(stride) != 3 or min(stride) < 1:  # a 0 divided the latent grid by zero
        raise argparse.ArgumentTypeError(f"{text!r} must be three integers >= 1 (t,h,w), e.g. 4,8,8")
    return stride


def base_quants(text: str) -> tuple[str, ...]:
    """An argparse `type=` for --base-quants: model.base_quant values, comma-separated."""
    quants = tuple(q for q in text.split(",") if q)
    bad = [q for q in quants if q not in one_gpu.ORDER]
    if bad or not quants:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(one_gpu.ORDER)} (comma-separated)")
    return quants


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=video_cp8 model=dit_1b")
    ap.add_argument("--world", type=ranged(int, Range(1, MAX_PLAN_WORLD, note="every split of it into the parallel "
                                                       "degrees is checked")),
                    default=0, help="ranks (default: the config's layout)")
    ap.add_argument("--gpu-mem-gib", type=POSITIVE_FLOAT, default=80.0, help="memory per rank (default 80, an H100)")
    ap.add_argument("--reserve-gib", type=ranged(float, Range(0)), default=2.0,
                    help="kept free for the CUDA context, NCCL buffers and allocator fragmentation")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="target device (picks the attention backend)")
    ap.add_argument("--backend", default="", help="attention backend to cost (default: model.attn_backend, auto -> flash on cuda)")
    ap.add_argument("--max-sample-tokens", type=ranged(int, Range(0, note="0 = train.micro_batch_tokens")), default=0, help="longest sample (default: train.micro_batch_tokens)")
    ap.add_argument("--mean-sample-tokens", type=ranged(float, Range(0, note="0 = the longest")), default=0, help="mean sample length (default: the longest)")
    ap.add_argument("--from-data", action="store_true", help="read sample lengths from the configured dataset")
    ap.add_argument("--max-micro-tokens", type=POSITIVE_INT, default=1 << 17)
    ap.add_argument("--ac", choices=("both", "on", "off", "all", "none", "selective", "full"), default="both",
                    help="activation checkpointing options (both = none and full; all = none, selective, full)")
    ap.add_argument("--offload", choices=("none", "all"), default="none",
                    help="also plan train.activation_offload and parallel.cpu_offload (all)")
    ap.add_argument("--prologues", choices=("both", "on", "off", "config"), default="both",
                    help="model.recompute_prologues settings to plan (both: off where it fits, on where memory is "
                         "short; config: the configured one)")
    ap.add_argument("--frames", type=ranged(int, Range(0, note="0 = no clip question")), default=0, help="pixel frames of one clip: answer which options fit it")
    ap.add_argument("--height", type=POSITIVE_INT, default=480, help="pixel height of the clip (with --frames)")
    ap.add_argument("--width", type=POSITIVE_INT, default=832, help="pixel width of the clip (with --frames)")
    ap.add_argument("--vae-stride", type=vae_stride, default="", help="VAE compression t,h,w (default: the model's model.vae_stride where it has one, e.g. 4,16,16 for wan22_ti2v_5b; else the family's VAE: Wan 4,8,8, LTX-Video 8,32,32)")
    ap.add_argument("--h2d-gib-s", type=POSITIVE_FLOAT, default=20.0,
                    help="host-to-device copy bandwidth for block swap (default 20 GiB/s: PCIe 4.0 x16 in practice)")
    ap.add_argument("--gpu-tflops", type=POSITIVE_FLOAT, default=80.0,
                    help="achieved TFLOP/s of the card for the swap's overlap model (default 80: an assumption for a "
                         "24-32 GB card in bf16, not measured)")
    ap.add_argument("--host-mem-gib", type=POSITIVE_FLOAT, default=128.0,
                    help="host memory per rank for the offload options (and the one-GPU plan's swapped blocks)")
    ap.add_argument("--base-quants", type=base_quants, default=one_gpu.DEFAULT_QUANTS,
                    help="one-GPU LoRA plan: the model.base_quant values to choose from (default none,int8,nf4; "
                         "walked in the order none, int8, fp8_scaled, fp8, nf4: planning/one_gpu.py)")
    ap.add_argument("--max-frames", type=POSITIVE_INT, default=4001, help="upper end of the longest-clip search")
    ap.add_argument("--top", type=POSITIVE_INT, default=12, help="rows to print")
    ap.add_argument("--json", default="", help="write every candidate and the rejected layouts here")
    ap.add_argument("--smoke", type=ranged(int, Range(0, note="0 = none")), default=0, help="run a few steps of the best K fitting candidates")
    ap.add_argument("--smoke-steps", type=POSITIVE_INT, default=4)
    ap.add_argument("--calibrate", action="store_true", help="measure one block's saved activations on CPU vs the formula")
    ap.add_argument("--calibrate-tokens", type=POSITIVE_INT, default=1024,
                    help="tokens of the calibration forward (few tokens on a wide model inflate per-parameter terms)")
    args = ap.parse_args(argv)

    cfg = compose(args.overrides)
    world = args.world or ParallelDims.from_config(cfg.parallel).world
    if world > MAX_PLAN_WORLD:  # the config's own layout (--world is checked by its type)
        degrees = " ".join(f"parallel.{k}={getattr(cfg.parallel, k)}" for k in PARALLEL_DEGREES if getattr(cfg.parallel, k) > 1)
        ap.error(f"{degrees} asks for {world} ranks; the planner plans for at most {MAX_PLAN_WORLD}: give --world")
    shape = model_shape(cfg.model)
    if args.from_data:
        work = workload_from_data(cfg)
    else:
        mx = args.max_sample_tokens or cfg.train.micro_batch_tokens or AUTO_MICRO_BATCH_TOKENS
        if args.mean_sample_tokens > mx:  # an impossible workload: a plan for it would mean nothing
            longest = (f"--max-sample-tokens={args.max_sample_tokens}" if args.max_sample_tokens else
                       f"train.micro_batch_tokens={cfg.train.micro_batch_tokens or f'0 = auto: {mx}'}")
            ap.error(f"--mean-sample-tokens={args.mean_sample_tokens:.15g} is above the longest sample ({longest}): a "
                     f"mean cannot exceed the maximum; lower --mean-sample-tokens or raise --max-sample-tokens")
        work = Workload(cfg.train.global_batch, mx, args.mean_sample_tokens or mx)
    backend = args.backend or resolve_plan_backend(cfg, args.device)
    prologues = {"both": (False, True), "on": (True,), "off": (False,), "config": ()}[args.prologues]
    if args.frames and cfg.model.lora.rank > 0 and world == 1:
        if args.smoke:  # before any output: a refusal is the only line
            ap.error(one_gpu_smoke_refusal())
        return one_gpu_main(args, cfg, shape, backend)
    if args.frames:
        return clip_main(args, cfg, world, shape, backend, prologues)
    ac = {"both": (False, True), "on": (True,), "off": (False,), "all": ("none", "selective", "full"),
          "none": ("none",), "selective": ("selective",), "full": ("full",)}[args.ac]
    offload = ((False, False),) if args.offload == "none" else ((False, False), (True, False), (False, True), (True, True))
    cands, rejected = plan(cfg, world, args.gpu_mem_gib * GIB, work, reserve_bytes=args.reserve_gib * GIB,
                           backend=backend, ac_options=ac, max_micro_tokens=args.max_micro_tokens, shape=shape,
                           offload_options=offload, prologue_options=prologues)
    shared = set.intersection(*(set(reasons) for _, reasons in rejected)) if rejected and not cands else set()
    if shared:  # every layout fails for the same reason: the config itself is wrong, not a layout
        print("error: " + "; ".join(sorted(shared)), file=sys.stderr)
        return 2

    print(f"model: {cfg.model.name} dim={shape.dim} depth={shape.depth} heads={shape.heads} "
          f"params={shape.params / 1e6:.1f}M | world={world} | {args.gpu_mem_gib:g} GiB/rank "
          f"(reserve {args.reserve_gib:g}) | precision={cfg.train.precision} optim={cfg.optim.name} attn={backend}")
    print(f"step: {work.global_batch} samples x {work.mean_sample_tokens:.0f} tokens (longest {work.max_sample_tokens})")
    calib = None
    if args.calibrate:
        calib = calibrate_block(cfg.model, tokens=args.calibrate_tokens, precision="bf16" if cfg.train.precision != "fp32" else "fp32")
        print(f"calibration (one block, CPU, {calib['precision']}): measured {calib['measured_bytes_per_token_block']:.0f} "
              f"B/token, formula {calib['estimated_bytes_per_token_block']:.0f} B/token, error {calib['rel_error']:+.2%}")
    if args.smoke:
        tried = [c for c in cands if c.fits][: args.smoke]
        smoke(cfg, tried, args.smoke_steps)
        # measured beats estimated: the smoked candidates go first, fastest (tokens/s) first
        tried.sort(key=lambda c: -c.smoke["tokens_per_s"])
        cands = tried + [c for c in cands if c not in tried]
    rows = [dict(rank=i + 1, **c.row()) for i, c in enumerate(cands[: args.top])]
    if not shape.moe_blocks:  # the ep column only means something with experts
        rows = [{k: v for k, v in r.items() if k not in ("ep", "expert_comm_GiB")} for r in rows]
    print(format_table(rows))
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
        Path(args.json).write_text(dumps_records({
            "world": world, "gpu_mem_gib": args.gpu_mem_gib, "backend": backend, "workload": work.__dict__,
            "model": dataclasses.asdict(shape), "calibration": calib, "candidates": [c.to_json() for c in cands],
            "rejected": [{"layout": lay.to_json(), "reasons": r} for lay, r in rejected]}))
        print(f"wrote {args.json}")
    return 0 if cands and cands[0].fits else 1


def one_gpu_smoke_refusal() -> str:
    """Why --smoke is refused for the one-GPU LoRA plan here: it would measure the choice's peak
    memory on a GPU, which this machine may not have, and that measurement is not written yet."""
    if not torch.cuda.is_available():
        return ("--smoke measures the one-GPU LoRA choice on a GPU and this machine has none (torch.cuda.is_available() "
                "is False); drop --smoke to get the modelled plan")
    return ("--smoke for the one-GPU LoRA plan (model.lora.rank > 0, one rank, --frames) is not implemented yet; drop "
            "--smoke and run the printed choice with python -m dit_train for a few steps to measure it")


def one_gpu_main(args, cfg, shape, backend: str) -> int:
    """--frames with model.lora.rank > 0 on one rank: choose model.base_quant, model.block_swap and
    activation checkpointing for the clip (dit_train/planning/one_gpu.py), print every term of the
    chosen option's estimate and the swap's modelled step-time cost."""
    if cfg.mode != "video":
        raise SystemExit(f"--frames needs a video model (model.name={cfg.model.name} is {cfg.mode})")
    stride = args.vae_stride or tuple(getattr(cfg.model, "vae_stride", None) or model_spec(cfg.model).vae_stride)
    tokens = clip_tokens(cfg.model, args.frames, args.height, args.width, stride)
    lora = adapter_parameters(cfg.model)
    opts = one_gpu.options(shape, lora, tokens, precision=cfg.train.precision, optimizer=cfg.optim.name,
                           ema=cfg.train.ema_decay > 0, backend=backend, capacity=args.gpu_mem_gib * GIB,
                           reserve=args.reserve_gib * GIB, h2d_bytes_per_s=args.h2d_gib_s * GIB,
                           flops_per_s=args.gpu_tflops * 1e12, host_capacity=args.host_mem_gib * GIB,
                           quants=args.base_quants)
    print(f"model: {cfg.model.name} dim={shape.dim} depth={shape.depth} params={shape.params / 1e9:.2f}B, LoRA rank "
          f"{cfg.model.lora.rank}: {lora / 1e6:.1f}M adapter params | one GPU of {args.gpu_mem_gib:g} GiB (reserve "
          f"{args.reserve_gib:g}) | precision={cfg.train.precision} optim={cfg.optim.name} attn={backend}")
    print(f"clip: {args.frames} frames x {args.height}x{args.width} px -> {tokens} tokens | host-to-device "
          f"{args.h2d_gib_s:g} GiB/s, {args.gpu_tflops:g} TFLOP/s assumed | host {args.host_mem_gib:g} GiB | "
          f"base_quant from {','.join(args.base_quants)}")
    best = one_gpu.choose(opts)
    shown = [o for o in opts if o.block_swap == 0 and not o.activation_offload]
    shown += [best] if best is not None and best not in shown else []
    print(format_table([o.row() for o in shown]))
    if best is None:
        worst = min(opts, key=lambda o: o.total)
        print(f"nothing fits: even {worst.base_quant} with {worst.block_swap} blocks swapped"
              f"{' and activations offloaded' if worst.activation_offload else ''} needs {worst.total / GIB:.1f} GiB on the "
              f"device and {worst.host / GIB:.1f} GiB of host memory; lower the clip (--frames / --height / --width) or use more GPUs")
        return 1
    print("estimate of the choice (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in best.terms.items())
          + f"; total {best.total / GIB:.2f} of {args.gpu_mem_gib:g}; host (pinned) {best.host / GIB:.2f}")
    if best.block_swap or best.activation_offload:
        print(f"host copies: block swap {best.block_swap} of {shape.depth} blocks"
              f"{', activations offloaded' if best.activation_offload else ''}: {best.swap_copy_s:.2f} s of copies per step, "
              f"{best.swap_exposed_s:.2f} s not hidden behind ~{best.compute_s:.2f} s of compute (modelled)")
    print("choice: " + " ".join(best.overrides()))
    return 0


def clip_main(args, cfg, world: int, shape, backend: str, prologues: tuple[bool, ...]) -> int:
    """--frames: for every AC x offload option, the best layout for the clip and the longest
    clip of the same height and width that fits, each with the `prologues` settings planned
    (off where it fits, on where only it does); --smoke K measures the fitting ones."""
    if cfg.mode != "video":
        raise SystemExit(f"--frames needs a video model (model.name={cfg.model.name} is {cfg.mode})")
    if args.vae_stride:
        stride = args.vae_stride
    else:  # the VAE the model's latents come from: a preset's own (Wan 2.2 TI2V: 16x spatial), else its family's
        stride = tuple(getattr(cfg.model, "vae_stride", None) or model_spec(cfg.model).vae_stride)
    tokens = clip_tokens(cfg.model, args.frames, args.height, args.width, stride)
    print(f"model: {cfg.model.name} dim={shape.dim} depth={shape.depth} heads={shape.heads} "
          f"params={shape.params / 1e9:.2f}B | world={world} x {args.gpu_mem_gib:g} GiB (reserve {args.reserve_gib:g}), "
          f"host {args.host_mem_gib:g} GiB/rank | precision={cfg.train.precision} optim={cfg.optim.name} attn={backend}")
    print(f"clip: {args.frames} frames x {args.height}x{args.width} px -> latents {latent_grid(args.frames, args.height, args.width, stride)} "
          f"(VAE stride {','.join(map(str, stride))}) -> {tokens} tokens (patch {list(cfg.model.patch_size)})")
    if args.calibrate:
        calib = calibrate_block(cfg.model, tokens=args.calibrate_tokens, precision="bf16" if cfg.train.precision != "fp32" else "fp32")
        print(f"calibration (one block, CPU, {calib['precision']}): error {calib['rel_error']:+.2%}")
    res = clip_options(cfg, world, args.gpu_mem_gib * GIB, args.frames, args.height, args.width, shape=shape,
                       reserve_bytes=args.reserve_gib * GIB, backend=backend, host_capacity=args.host_mem_gib * GIB,
                       vae_stride=stride, max_frames=args.max_frames, prologue_options=prologues)
    print(format_table([r.row(args.frames) for r in res]))
    fitting = [r for r in res if r.best is not None and r.best.fits]
    if fitting:
        print("cheapest option that fits: " + " ".join(fitting[0].best.layout.overrides()))
    else:
        print(f"no option fits {args.frames} frames at {args.height}x{args.width}: raise --world or --gpu-mem-gib")
    if args.smoke:
        # measured peak (torch.cuda.max_memory_allocated) next to the estimate: the data must
        # hold clips of this size (e.g. a latent cache of such clips)
        tried = [r.best for r in fitting][: args.smoke]
        smoke(cfg, tried, args.smoke_steps)
        print(format_table([dict(option=r.name, **r.best.row()) for r in fitting[: args.smoke]]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(dumps_records({
            "world": world, "gpu_mem_gib": args.gpu_mem_gib, "host_mem_gib": args.host_mem_gib, "backend": backend,
            "clip": {"frames": args.frames, "height": args.height, "width": args.width, "tokens": tokens},
            "model": dataclasses.asdict(shape), "options": [r.to_json() for r in res]}))
        print(f"wrote {args.json}")
    return 0 if fitting else 1


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
