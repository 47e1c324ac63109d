#!/usr/bin/env python
"""Full model weights (safetensors) from any checkpoint, on one process.

    python tools/export_weights.py outputs/run/checkpoints/step_00000100            # -> <ckpt>/weights.safetensors
    python tools/export_weights.py outputs/run --out weights_latest.safetensors      # newest checkpoint of a run

Key names are those of the plain model, the same as the run's own weights.safetensors,
whatever layout wrote the checkpoint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX dir, or a run dir (its newest checkpoint)")
    ap.add_argument("--out", default=None, help="output .safetensors (default: <checkpoint>/weights.safetensors)")
    args = ap.parse_args(argv)

    from dit_train.checkpoint import export_checkpoint, resolve_checkpoint

    try:
        ckpt = resolve_checkpoint(args.checkpoint, args.checkpoint)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else ckpt / "weights.safetensors"
    export_checkpoint(ckpt, out)
    print(f"wrote {out} (from {ckpt})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
