"""Score a trained shapes-world run: one JSON and one grid, the figures the docs' tables quote.

    python -m dit_train.tools.evaluate RUN                      # the 48 held-out compositions (default)
    python -m dit_train.tools.evaluate RUN --train-captions     # the captions of its first 48 training clips
    python -m dit_train.tools.evaluate RUN --heldout --n 96 --steps 30 --guidance 2

RUN is any folder `tools.sample` reads: a training run, a `tools.video_rl --out` folder, a
distilled student. `--heldout` samples the 48 compositions (colour, shape, direction,
background) that the embedded world keeps out of its clips (`data.heldout_compositions`,
synthetic_video.caption_split) at 8 frames x 32 x 32, one clip each (`--n 96`: two clips
each, other noise); `--train-captions` samples the first `--n` training clips' captions and
sizes, as the run's validation does. The sampler is the run's validation sampler
(train.sample_steps, train.guidance_scale, train.stochastic_sampling, train.seed) unless
`--steps`, `--guidance`, `--(no-)stochastic` or `--seed` say otherwise; the EMA weights when
the run has them. A run with an audio stream (model.audio_patch: the two-stream DiT, LTX-2)
generates each clip's sound too, and its figures join the picture's: sound_color_ok (the pitch
names the caption's colour), sound_sync_ok (clicks within one frame of the bounces seen in the
generated pixels), sound_all_ok (data_pipelines/shapes_sound_metric.py).

A run trained with cond.given_stream=video: `--given-video` gives each held-out caption a clip of
its composition, rendered as the world's clips are (synthetic_video.render_long_clip, index k,
written as H.264 mp4s under OUT/given/), and generates only its sound (tools.sample --video):
the sound figures then score video-to-audio against the bounces of the given frames.

    python -m dit_train.tools.evaluate V2A_RUN --heldout --given-video

The drift of a block-causal run (docs/causal.md): `--frames 32 --overlap-frames 4` streams each
held-out caption past the training length (tools.sample's KV cache and sliding window) and
scores every 8-frame window of the long clip against the caption and against window 1, beside
rendered long clips of the same compositions (the ceiling); OUT/drift.png plots the figures
against the window index and OUT/drift_grid.png shows the first clips whole:

    python -m dit_train.tools.evaluate CAUSAL_RUN --heldout --frames 32 --overlap-frames 4
    python -m dit_train.tools.evaluate CAUSAL_RUN --heldout --frames 32 --overlap-frames 4 --ar-step 1   # asynchronous

Writes OUT/evaluate.json (the figures, the settings, the weights) beside the
clips and grid.png, appends the same row to RUN/eval/evaluations.jsonl, and prints one line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dit_train.compose import load_config
from dit_train.data_pipelines.synthetic_video import EVAL_SIZE, caption_split, render_long_clip, write_mp4
from dit_train.engine.checks import Range
from dit_train.tools import sample
from dit_train.tools.args import POSITIVE_INT, ToolParser, ranged
from dit_train.tools.evaluate_drift import check_drift, drift_line, drift_report, is_drift

def sampler_settings(args: argparse.Namespace, train) -> dict:
    """The run's validation sampler, with the flags given on top."""
    return {"steps": args.steps or train.sample_steps,
            "guidance": train.guidance_scale if args.guidance is None else args.guidance,
            "stochastic": train.stochastic_sampling if args.stochastic is None else args.stochastic,
            "seed": train.seed if args.seed is None else args.seed, "audio_guidance": args.audio_guidance}


def sample_argv(args: argparse.Namespace, settings: dict, out: Path) -> list[str]:
    """tools.sample's command line for this evaluation."""
    argv = [str(args.run_dir), "--out", str(out), "--steps", str(settings["steps"]), "--guidance",
            str(settings["guidance"]), "--seed", str(settings["seed"]),
            "--stochastic" if settings["stochastic"] else "--no-stochastic", "--device", args.device]
    if settings["audio_guidance"]:
        argv += ["--audio-guidance", str(settings["audio_guidance"])]
    if args.ema is not None:
        argv.append("--ema" if args.ema else "--no-ema")
    if args.train_captions:
        return argv + ["--data-captions", str(args.n)]
    _, height, width = EVAL_SIZE
    argv += ["--frames", str(args.frames), "--height", str(height), "--width", str(width)]
    if args.overlap_frames:
        argv += ["--overlap-frames", str(args.overlap_frames)]
    if args.ar_step:
        argv += ["--ar-step", str(args.ar_step)]
    for k, caption in enumerate(heldout_captions(args.n)):
        argv += ["--prompt", caption]
        if args.given_video:
            argv += ["--video", str(given_clip(out / "given", caption, k, args.frames))]
    return argv


def given_clip(folder: Path, caption: str, k: int, frames: int) -> Path:
    """OUT/given/clip_<k>.mp4: clip k of `caption`'s composition at EVAL_SIZE (the world's
    renderer and encoder, fps 8), the video given to a video-to-audio run."""
    _, height, width = EVAL_SIZE
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"clip_{k:04d}.mp4"
    write_mp4(path, render_long_clip(caption, frames, height, width, index=k))
    return path


def heldout_captions(n: int) -> list[str]:
    """The first n held-out compositions' captions (beyond 48: each again, with the next noise ids)."""
    heldout = caption_split()[1]
    return [heldout[i % len(heldout)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.evaluate", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a run folder (config.yaml + weights or checkpoints)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--heldout", action="store_true", help="the 48 held-out compositions (the default)")
    which.add_argument("--train-captions", action="store_true", help="the captions and sizes of its first N training clips")
    ap.add_argument("--n", type=POSITIVE_INT, default=48, help="clips to sample (default 48)")
    ap.add_argument("--steps", type=POSITIVE_INT, default=None, help="sampler steps (default: the run's train.sample_steps)")
    ap.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the run's train.guidance_scale)")
    ap.add_argument("--audio-guidance", type=float, default=0.0, metavar="GA",
                    help="a run with sound: the guidance of the sound (tools.sample's --audio-guidance; default 0 = "
                         "--guidance)")
    ap.add_argument("--stochastic", action=argparse.BooleanOptionalAction, default=None,
                    help="the stochastic sampler step (default: the run's train.stochastic_sampling)")
    ap.add_argument("--seed", type=int, default=None, help="noise seed (default: the run's train.seed)")
    ema = ap.add_mutually_exclusive_group()
    ema.add_argument("--ema", dest="ema", action="store_true", default=None, help="require the EMA weights")
    ema.add_argument("--no-ema", dest="ema", action="store_false", help="use the training weights")
    ap.add_argument("--frames", type=POSITIVE_INT, default=EVAL_SIZE[0],
                    help=f"frames per held-out clip (default {EVAL_SIZE[0]}); more on a block-causal run: the drift "
                         f"measurement, streamed and scored per {EVAL_SIZE[0]}-frame window")
    ap.add_argument("--overlap-frames", type=ranged(int, Range(0)), default=0, metavar="N",
                    help="with --frames past the run's training length: frames of the last window that open the "
                         "next one (tools.sample's --overlap-frames)")
    ap.add_argument("--ar-step", type=ranged(int, Range(0)), default=0, metavar="N",
                    help="a block-causal run: stream with SkyReels-V2's asynchronous schedule (tools.sample's "
                         "--ar-step; default 0, block by block)")
    ap.add_argument("--given-video", action="store_true",
                    help="a run trained with cond.given_stream=video: give each held-out caption a rendered clip of "
                         "its composition and generate only its sound (video-to-audio)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--out", type=Path, default=None, help="output folder (default RUN/eval/<which>_<time>)")
    args = ap.parse_args(argv)

    try:
        cfg = load_config(args.run_dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    kind = "train" if args.train_captions else "heldout"
    if args.given_video and (args.train_captions or not cfg.cond.gives_video):
        print("error: --given-video gives the held-out captions rendered clips (drop --train-captions) to a run trained "
              f"with cond.given_stream=video (this one: cond.given_stream={cfg.cond.given_stream})", file=sys.stderr)
        return 2

    if cfg.mode != "video":
        print(f"error: {args.run_dir} trained mode={cfg.mode}; tools.evaluate scores video runs", file=sys.stderr)
        return 2
    if kind == "heldout" and not hasattr(cfg.data, "heldout_compositions"):
        print(f"error: --heldout samples the embedded shapes world's held-out compositions, but {args.run_dir} trained "
              f"on data={cfg.data.name}; use --train-captions, or python -m dit_train.tools.sample", file=sys.stderr)
        return 2
    drift = is_drift(args)
    try:
        if drift:
            check_drift(args, cfg)
        elif args.overlap_frames:
            raise ValueError(f"--overlap-frames slides the window of a clip longer than {EVAL_SIZE[0]} frames: give "
                             f"--frames (e.g. 32) on a block-causal run, or drop it")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if kind == "heldout" and not cfg.data.heldout_compositions:
        print(f"warning: {args.run_dir} trained with data.heldout_compositions=false: its clips may show the held-out "
              f"compositions, so these figures are not generalisation", file=sys.stderr)
    settings = sampler_settings(args, cfg.train)
    folder = kind + ("_given_video" if args.given_video else "")
    out = args.out or args.run_dir / "eval" / f"{folder}_{time.strftime('%Y%m%d-%H%M%S')}"
    code = sample.main(sample_argv(args, settings, out))
    if code:
        return code
    info = json.loads((out / "info.json").read_text())
    scores = {k[5:]: v for k, v in info.get("scores", {}).items() if k.startswith("eval/")}
    if not scores:
        print(f"error: data={cfg.data.name} has no exact metric to score the clips with (the embedded shapes world "
              f"has); the clips are in {out}", file=sys.stderr)
        return 2
    row = {"run": str(args.run_dir), "which": kind, "n": args.n, **settings, "weights": info.get("weights"),
           "scores": scores, "grid": str(out / "grid.png"), "frames": args.frames, "overlap_frames": args.overlap_frames,
           "ar_step": args.ar_step, "given_video": args.given_video}
    if drift:
        row["drift"] = drift_report(out, heldout_captions(args.n), args.frames)
    (out / "evaluate.json").write_text(json.dumps(row, indent=2) + "\n")
    log = args.run_dir / "eval" / "evaluations.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(json.dumps(row) + "\n")
    figures = " ".join(f"{k}={v:.2f}" for k, v in scores.items() if not k.startswith("num"))
    print(f"{folder} ({args.n} clips, {settings['steps']} steps, guidance {settings['guidance']:g}"
          f"{', stochastic' if settings['stochastic'] else ''}): {figures}")
    if drift:
        print(drift_line(row["drift"]))
    print(f"wrote {out / 'evaluate.json'} and {out / 'grid.png'}" + (" (drift.png, drift_grid.png)" if drift else ""))
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
