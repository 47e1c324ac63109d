"""Full model weights (safetensors), LoRA adapters or diffusers folders out of a run, on one process.

    python -m dit_train.tools.export_weights outputs/run/checkpoints/step_00000100            # -> <ckpt>/weights.safetensors
    python -m dit_train.tools.export_weights outputs/run --out weights_latest.safetensors      # newest checkpoint of a run
    python -m dit_train.tools.export_weights outputs/run --diffusers wan_finetuned/            # model=wan: a diffusers folder
    python -m dit_train.tools.export_weights outputs/run/weights.safetensors --diffusers wan_finetuned/
    python -m dit_train.tools.export_weights outputs/run --ema --diffusers wan_ema/          # the EMA weights
    python -m dit_train.tools.export_weights outputs/lora_run                                # LoRA run: the adapters
    python -m dit_train.tools.export_weights outputs/lora_run --diffusers my_adapters/        # the adapters, into DIR
    python -m dit_train.tools.export_weights outputs/lora_run --merge-lora --diffusers wan_merged/
    python -m dit_train.tools.export_weights outputs/wan_lora --base --diffusers wan_base/   # the base it trained on

Source: a run dir's newest intact checkpoint, or a given checkpoint dir; a run dir without
checkpoints (train.ckpt_every=0, the default) exports from the files the run wrote at its end
(weights.safetensors, lora/; weights_ema.safetensors, lora_ema/ with --ema).

A LoRA run (model.lora.rank > 0) exports its adapters in diffusers' LoRA format
(pytorch_lora_weights.safetensors, loadable with WanPipeline.load_lora_weights) into --diffusers
DIR or --out DIR (default <checkpoint>/lora/); --merge-lora exports the base with the adapters
merged in instead. --base exports the model the run started from, with no adapters: its
model.pretrained weights, or the initialisation from its train.seed (for the CPU example
`+experiment=wan_lora`, the tiny random base its adapters load onto).

Key names are those of the plain model, the same as the run's own weights.safetensors,
whatever layout wrote the checkpoint. With --diffusers (model.name=wan runs) full weights go
into a WanTransformer3DModel folder (save_pretrained) that diffusers' from_pretrained and
WanPipeline load, and that model.pretrained accepts.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from dit_train.checkpoint import checkpoint_weights, export_diffusers, find_checkpoint, save_safetensors
from dit_train.checkpoint.export import checkpoint_model, initial_weights, load_safetensors, run_lora_dirs
from dit_train.compose import load_config
from dit_train.config.errors import CheckpointError
from dit_train.models import model_spec
from dit_train.models.lora import save_lora, WEIGHT_NAME
from dit_train.tools.args import ToolParser


def _lora(cfg: Any, args: argparse.Namespace) -> bool:
    """The adapters are wanted (a LoRA run without --merge-lora)."""
    return cfg.model.lora.rank > 0 and not args.merge_lora


def _lora_dests(cfg: Any, root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """{state-dict prefix: folder its LoRA file goes to}: with --diffusers DIR each transformer's
    pipeline component (an A14B expert's subfolder), else root's layout of the run's own lora/."""
    if args.diffusers:
        parts = model_spec(cfg.model).components(cfg.model)
        return {prefix: Path(args.diffusers) / sub for prefix, sub in parts.items()}
    return run_lora_dirs(cfg.model, root)


def _full_weights(cfg: Any, sd: dict, args: argparse.Namespace, default: Path) -> Path:
    if args.diffusers:
        return export_diffusers(cfg, sd, args.diffusers)
    out = Path(args.out) if args.out else default
    save_safetensors(sd, out)
    return out


def _from_weights_file(src: Path, args: argparse.Namespace) -> Path:
    """A run's weights.safetensors (full weights; merged for LoRA runs) -> --diffusers DIR."""
    if not args.diffusers:
        raise ValueError("a .safetensors input only makes sense with --diffusers DIR")
    if args.ema:
        raise ValueError("--ema picks weights_ema.safetensors of a run dir; with a .safetensors input pass that file")
    if not (src.parent / "config.yaml").exists():
        raise FileNotFoundError(f"{src.parent} has no config.yaml (pass a weights.safetensors inside its run dir)")
    return export_diffusers(load_config(src.parent), load_safetensors(src), args.diffusers)


def _base(src: Path, args: argparse.Namespace) -> Path:
    """--base: the weights the run started from (no adapters)."""
    cfg = load_config(src)
    return _full_weights(cfg, initial_weights(cfg), args, src / "weights_base.safetensors")


def _from_checkpoint(ckpt: Path, args: argparse.Namespace) -> Path:
    cfg = load_config(ckpt)
    suffix = "_ema" if args.ema else ""
    if _lora(cfg, args):
        _, model = checkpoint_model(ckpt, args.ema)
        root = Path(args.out) if args.out else ckpt / f"lora{suffix}"
        written = [save_lora(model, out, model_spec(cfg.model).name, component=prefix)
                   for prefix, out in _lora_dests(cfg, root, args).items()]
        return written[0] if len(written) == 1 else root if not args.diffusers else Path(args.diffusers)
    return _full_weights(cfg, checkpoint_weights(ckpt, args.ema)[1], args, ckpt / f"weights{suffix}.safetensors")


def _from_run_files(run: Path, args: argparse.Namespace) -> Path | None:
    """A run dir without checkpoints: what it wrote at its end. None when the wanted file is
    already where no --out/--diffusers was asked for (nothing to write)."""
    if not (run / "config.yaml").is_file() or not (run / "weights.safetensors").is_file():
        raise FileNotFoundError(f"{run} holds no checkpoint (checkpoints/step_XXXXXXXX) and no finished run's "
                                f"weights (config.yaml + weights.safetensors): pass a checkpoint dir, a run dir, or a "
                                f"run's weights.safetensors with --diffusers DIR")
    cfg = load_config(run)
    suffix = "_ema" if args.ema else ""
    lora_dirs = run_lora_dirs(cfg.model, run / f"lora{suffix}")
    srcs = [d / WEIGHT_NAME for d in lora_dirs.values()] if _lora(cfg, args) else [run / f"weights{suffix}.safetensors"]
    for src in srcs:
        if not src.is_file():
            raise FileNotFoundError(f"{src} is missing" + (" (the run has no EMA weights): drop --ema" if args.ema else ""))
    dest = args.diffusers or args.out
    if dest is None:
        where = srcs[0] if len(srcs) == 1 else run / f"lora{suffix}"
        print(f"{run} has no checkpoint; its export is already at {where} (give --out or --diffusers to write it "
              f"elsewhere)")
        return None
    if _lora(cfg, args):  # the files are already in diffusers' LoRA format: DIR/pytorch_lora_weights.safetensors
        written = []
        for prefix, out in _lora_dests(cfg, Path(dest), args).items():
            out.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copyfile(lora_dirs[prefix] / WEIGHT_NAME, out / WEIGHT_NAME)))
        return written[0] if len(written) == 1 else Path(dest)
    return _full_weights(cfg, load_safetensors(srcs[0]), args, run / srcs[0].name)


def export(args: argparse.Namespace) -> tuple[Path | None, Path]:
    """(what was written or None, the source it came from); raises with a one-line message."""
    src = Path(args.checkpoint)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist (pass a checkpoint dir, a run dir or a run's weights.safetensors)")
    if args.out and args.diffusers:
        raise ValueError("give --out or --diffusers DIR, not both")
    if args.base and (args.merge_lora or args.ema):
        raise ValueError("--base exports the weights the run started from: without --merge-lora or --ema")
    if src.suffix == ".safetensors":
        if args.base:
            raise ValueError("--base takes a run dir (its config.yaml), not a .safetensors file")
        return _from_weights_file(src, args), src
    if args.base:
        return _base(src, args), src
    ckpt = find_checkpoint(src)
    if ckpt is not None:
        return _from_checkpoint(ckpt, args), ckpt
    return _from_run_files(src, args), src


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.export_weights", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX dir, a run dir (its newest checkpoint, else the "
                                       "weights it wrote), or (with --diffusers) a run's weights.safetensors")
    ap.add_argument("--out", default=None, help="output .safetensors (LoRA adapters: a folder; default: "
                                                "<checkpoint>/weights.safetensors or <checkpoint>/lora/)")
    ap.add_argument("--diffusers", default=None, metavar="DIR",
                    help="write into DIR for diffusers: a model folder of the full weights (model.name=wan), or for "
                         "a LoRA run without --merge-lora the adapters (DIR/pytorch_lora_weights.safetensors)")
    ap.add_argument("--merge-lora", action="store_true",
                    help="LoRA runs: full weights with the adapters merged (default: the adapters alone)")
    ap.add_argument("--ema", action="store_true",
                    help="the EMA weights (runs with train.ema_decay > 0; default output <checkpoint>/weights_ema.safetensors)")
    ap.add_argument("--base", action="store_true",
                    help="the weights the run started from, without adapters: model.pretrained's, or the "
                         "initialisation from train.seed (default output <run>/weights_base.safetensors)")
    args = ap.parse_args(argv)

    try:
        out, source = export(args)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out is not None:
        print(f"wrote {out} (from {source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
