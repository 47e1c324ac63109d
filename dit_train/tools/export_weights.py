"""Full model weights (safetensors) from any checkpoint, on one process.

    python -m dit_train.tools.export_weights outputs/run/checkpoints/step_00000100            # -> <ckpt>/weights.safetensors
    python -m dit_train.tools.export_weights outputs/run --out weights_latest.safetensors      # newest checkpoint of a run
    python -m dit_train.tools.export_weights outputs/run --diffusers wan_finetuned/            # model=wan: a diffusers folder
    python -m dit_train.tools.export_weights outputs/run/weights.safetensors --diffusers wan_finetuned/
    python -m dit_train.tools.export_weights outputs/run --ema --diffusers wan_ema/          # the EMA weights
    python -m dit_train.tools.export_weights outputs/lora_run                                # LoRA run: the adapters
    python -m dit_train.tools.export_weights outputs/lora_run --merge-lora --diffusers wan_merged/

A LoRA run (model.lora.rank > 0) exports its adapters in diffusers' LoRA format
(<out>/pytorch_lora_weights.safetensors, default <checkpoint>/lora/), loadable with
WanPipeline.load_lora_weights; --merge-lora writes the base with the adapters merged in instead.

Key names are those of the plain model, the same as the run's own weights.safetensors,
whatever layout wrote the checkpoint. With --diffusers (model.name=wan runs) the output is a
WanTransformer3DModel folder (save_pretrained) that diffusers' from_pretrained and
WanPipeline load, and that model.pretrained accepts.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dit_train.tools.args import ToolParser


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.export_weights", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX dir, a run dir (its newest checkpoint), "
                                       "or (with --diffusers) a run's weights.safetensors")
    ap.add_argument("--out", default=None, help="output .safetensors (default: <checkpoint>/weights.safetensors)")
    ap.add_argument("--diffusers", default=None, metavar="DIR",
                    help="write a diffusers model folder (model.name=wan) instead of one .safetensors")
    ap.add_argument("--merge-lora", action="store_true",
                    help="LoRA runs: full weights with the adapters merged (default: the adapters alone)")
    ap.add_argument("--ema", action="store_true",
                    help="the EMA weights (runs with train.ema_decay > 0; default output <checkpoint>/weights_ema.safetensors)")
    args = ap.parse_args(argv)

    from dit_train.checkpoint import checkpoint_weights, export_checkpoint, export_diffusers, resolve_checkpoint
    from dit_train.config import load_config

    src = Path(args.checkpoint)
    if src.suffix == ".safetensors":
        if not args.diffusers:
            print("error: a .safetensors input only makes sense with --diffusers", file=sys.stderr)
            return 2
        if not (src.parent / "config.yaml").exists():
            print(f"error: {src.parent} has no config.yaml (pass a weights.safetensors inside its run dir)", file=sys.stderr)
            return 2
        from safetensors.torch import load_file

        out = export_diffusers(load_config(src.parent), load_file(str(src)), args.diffusers)
        print(f"wrote {out} (from {src})")
        return 0
    try:
        ckpt = resolve_checkpoint(args.checkpoint, args.checkpoint)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        from dit_train.checkpoint.export import checkpoint_model

        cfg = load_config(ckpt)
        if cfg.model.lora.rank > 0 and not args.merge_lora:
            from dit_train.models import model_spec
            from dit_train.models.lora import save_lora

            _, model = checkpoint_model(ckpt, args.ema)
            out = save_lora(model, Path(args.out) if args.out else ckpt / ("lora_ema" if args.ema else "lora"),
                            model_spec(cfg.model).name)
        elif args.diffusers:
            out = export_diffusers(*checkpoint_weights(ckpt, args.ema), args.diffusers)
        else:
            out = Path(args.out) if args.out else ckpt / ("weights_ema.safetensors" if args.ema else "weights.safetensors")
            export_checkpoint(ckpt, out, args.ema)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (from {ckpt})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
