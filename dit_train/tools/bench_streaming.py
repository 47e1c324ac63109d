"""Time per generated frame: a block-causal model streamed with its KV cache vs sampled
full-sequence (docs/causal.md).

    python -m dit_train.tools.bench_streaming [--model dit_tiny] [--steps 10] [--frames 8 16] [--repeat 2]

The model preset with model.causal_block_frames=--block (random weights: the cost does not depend
on them), one clip of --size² pixels, no guidance, one CPU thread unless --threads; the best of
--repeat runs of each. On the CPU the time is this process's CPU time (on one thread, the wall
time of an idle core; a shared machine's other jobs disturb it far less than wall time), on a GPU
(--device cuda) the wall time, synchronised. Full-sequence rows stop at --window (the training length a run would have);
streamed rows go on past it through the sliding window with --overlap frames.
"""
from __future__ import annotations

import argparse
import time

import torch

from dit_train.compose import compose
from dit_train.config import ParallelConfig
from dit_train.models import build_model
from dit_train.parallel.mesh import init_parallel
from dit_train.sampling import SampleRequest, VideoSampler
from dit_train.sampling.streaming import StreamingSampler
from dit_train.tasks.video_inputs import video_inputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dit_tiny")
    ap.add_argument("--block", type=int, default=4, help="model.causal_block_frames")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--frames", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--window", type=int, default=8, help="the training length: full-sequence up to it, streamed past it")
    ap.add_argument("--overlap", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = compose([f"model={args.model}", f"model.causal_block_frames={args.block}", "parallel.device=cpu"])
    device = torch.device(args.device)
    model = build_model(cfg.model).eval().to(device)
    for p in model.parameters():  # zero-initialised layers would skip nothing, but keep the numbers ordinary
        torch.nn.init.normal_(p, std=0.02)
    inputs, ctx = video_inputs(cfg.model, cfg.cond), init_parallel(ParallelConfig(device=args.device))
    clock = time.process_time if args.device == "cpu" else time.perf_counter
    text = cfg.model.text_dim
    null = torch.zeros(cfg.model.text_len, text) if text else None

    def best(kind, frames, **kw) -> float:
        caption = torch.randn(cfg.model.text_len, text) if text else None
        times = []
        for _ in range(args.repeat):
            sampler = kind([SampleRequest("c", (cfg.model.in_channels, frames, args.size, args.size), "", caption, 0)],
                           inputs, null, ctx, args.steps, 1.0, 0, **kw)
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = clock()
            sampler.sample(model)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(clock() - start)
        return min(times)

    print(f"{args.model}, K = {args.block}, {args.size}², {args.steps} steps, {args.device}: "
          f"{'CPU time, ' + str(args.threads) + ' thread(s)' if args.device == 'cpu' else 'wall time'}")
    print("| frames | full-sequence | streamed (KV cache) |\n|---|---|---|")
    for frames in args.frames:
        full = best(VideoSampler, frames) if frames <= args.window else None
        stream = best(StreamingSampler, frames, block_frames=args.block, window_frames=args.window,
                      overlap_frames=args.overlap)
        cell = f"{full:.2f} s ({full / frames * 1e3:.0f} ms/frame)" if full is not None else "—"
        print(f"| {frames} | {cell} | {stream:.2f} s ({stream / frames * 1e3:.0f} ms/frame) |", flush=True)
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
