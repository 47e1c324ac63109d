"""Print the shapes-world metric for the real clips of an embedded set and for noise: the
reference rows that validation's eval/ figures are read against.

    python -m dit_train.tools.score_shapes                                  # default set: 48 clips, seed 1234
    python -m dit_train.tools.score_shapes --num-clips 16 --cache-dir /tmp/c
    python -m dit_train.tools.score_shapes --widths 32 --heights 24 32 40 --frames 4 8   # the quickstart set (conf/data/synthetic_video.yaml)
    python -m dit_train.tools.score_shapes --num-images 48                  # with still images (eval/image/, eval/video/ too)
    python -m dit_train.tools.score_shapes --json ref.json                  # also write the rows as JSON

Rows: the real clips decoded with decord and images with Pillow (what a perfect generator
reaches, H.264 included), then Gaussian noise ([3, F, H, W] ~ N(0, 1), clamped) and uniform
noise in [-1, 1] of the same sizes and captions (what an untrained model reaches).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dit_train.data_pipelines.shapes_metric import FIGURES, reference_scores, score_clips
from dit_train.data_pipelines.synthetic_video import ensure_synthetic_videos, FRAMES, HEIGHTS, WIDTHS
from dit_train.tools.args import NON_NEGATIVE_INT, POSITIVE_INT, ToolParser


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.score_shapes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default="~/.cache/dit_train", help="data.cache_dir (the set is written if missing)")
    ap.add_argument("--num-clips", type=POSITIVE_INT, default=48)
    ap.add_argument("--gen-seed", type=int, default=1234)
    ap.add_argument("--widths", type=int, nargs="+", default=None, help="data.widths (default: the generator's)")
    ap.add_argument("--heights", type=int, nargs="+", default=None, help="data.heights")
    ap.add_argument("--frames", type=int, nargs=2, default=None, help="data.frames: min max")
    ap.add_argument("--num-images", type=NON_NEGATIVE_INT, default=0, help="data.num_images: still images next to the clips")
    ap.add_argument("--noise-seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write {row: figures} here")
    args = ap.parse_args(argv)

    root = ensure_synthetic_videos(args.cache_dir, args.num_clips, args.gen_seed, args.num_images, args.widths or WIDTHS,
                                   args.heights or HEIGHTS, args.frames or FRAMES)
    items = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines() if line.strip()]
    captions = [it["caption"] for it in items]
    shapes = [(3, it["frames"], it["height"], it["width"]) for it in items]
    g = torch.Generator().manual_seed(args.noise_seed)
    rows = {
        "real (decoded)": reference_scores(root),
        "gaussian noise": score_clips([torch.randn(s, generator=g) for s in shapes], captions),
        "uniform noise": score_clips([torch.rand(s, generator=g) * 2 - 1 for s in shapes], captions),
    }
    print(f"{root} ({len(items)} clips)")
    print(f"{'':16}" + "".join(f"{k:>15}" for k in FIGURES))
    for name, s in rows.items():
        print(f"{name:16}" + "".join(f"{s.get('eval/' + k, float('nan')):15.3f}" for k in FIGURES))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
