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
    python -m dit_train.tools.export_weights outputs/wan_lora --lora-format comfyui          # + lora/lora_comfyui.safetensors

Source: a run dir's newest intact checkpoint, or a given checkpoint dir; a run dir without
checkpoints (train.ckpt_every=0, the default) exports from the files the run wrote at its end
(weights.safetensors, lora/; weights_ema.safetensors, lora_ema/ with --ema).

A LoRA run (model.lora.rank > 0) exports its adapters in diffusers' LoRA format
(pytorch_lora_weights.safetensors, loadable with WanPipeline.load_lora_weights) into --diffusers
DIR or --out DIR (default <checkpoint>/lora/); --merge-lora exports the base with the adapters
merged in instead. --base exports the model the run started from, with no adapters: its
model.pretrained weights, or the initialisation from its train.seed (for the CPU example
`+experiment=wan_lora`, the tiny random base its adapters load onto).

--lora-format comfyui|kohya also writes the adapters as ComfyUI / musubi-tuner name them (Wan, Wan
VACE, SkyReels-V2, LTX-Video, LTX-2, HunyuanVideo 1.5: each family's key map; our DiT is refused),
beside the diffusers file: lora_comfyui.safetensors or lora_kohya.safetensors in the same folder
(dit_train/models/lora_formats.py; docs/one-gpu.md).

Key names are those of the plain model, the same as the run's own weights.safetensors,
whatever layout wrote the checkpoint. With --diffusers (model.name=wan runs) full weights go
into a WanTransformer3DModel folder (save_pretrained) that diffusers' from_pretrained and
WanPipeline load, and that model.pretrained accepts.

Nothing is replaced silently: a destination file that exists (--out FILE, a default output, a
LoRA file), or a --diffusers folder already holding a model, is refused naming it unless
--overwrite. Files are written under a temporary name beside their destination and renamed into
place, so a failed or interrupted export leaves the old file (or none), never half a file.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from dit_train.atomic import copy_atomic
from dit_train.checkpoint import checkpoint_weights, export_diffusers, find_checkpoint, save_safetensors
from dit_train.checkpoint.export import (checkpoint_model, diffusers_model_dirs, initial_weights, load_safetensors,
                                         model_files, run_lora_dirs)
from dit_train.compose import load_config
from dit_train.config.errors import CheckpointError
from dit_train.models import model_spec
from dit_train.models.lora import METADATA_KEY, PREFIX, TRAINED_MODULES, WEIGHT_NAME, save_lora
from dit_train.models import lora_formats
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


def _format_file(d: Path, fmt: str) -> Path:
    return d / f"lora_{fmt}.safetensors"


def _check_lora_format(cfg: Any, dirs: list[Path], args: argparse.Namespace) -> None:
    """--lora-format other than diffusers: a LoRA export of a family with a key map (models/lora_formats.py),
    whose converted files do not exist yet."""
    if args.lora_format == "diffusers":
        return
    if not _lora(cfg, args):
        raise ValueError(f"--lora-format {args.lora_format} writes a LoRA run's adapters as ComfyUI / kohya tools name "
                         f"them; full weights (not a LoRA run's adapters) have no such layout: use --lora-format diffusers")
    lora_formats.key_map(model_spec(cfg.model))  # our DiT, or a family whose names were not read: refused
    for d in dirs:
        if _format_file(d, args.lora_format).exists() and not args.overwrite:
            raise ValueError(f"{_format_file(d, args.lora_format)} exists: pass --overwrite to replace it, or {_other(args)}")


def _write_lora_format(cfg: Any, written: list[Path], args: argparse.Namespace) -> list[Path]:
    """Each written diffusers LoRA file, converted to --lora-format beside it under the family's key
    map (alpha from its header)."""
    if args.lora_format == "diffusers":
        return written
    keys = lora_formats.key_map(model_spec(cfg.model))
    out = []
    for src in written:
        with safe_open(str(src), "pt") as f:
            header = json.loads((f.metadata() or {}).get(METADATA_KEY, "{}"))
        sd = load_file(str(src))
        rank = next(v.shape[0] for k, v in sd.items() if ".lora_A." in k)
        alpha = header.get(f"{PREFIX}.lora_alpha", rank)  # diffusers' reading: no metadata = alpha r
        dest = _format_file(src.parent, args.lora_format)
        with _writing(dest):
            save_safetensors(lora_formats.convert(sd, alpha, args.lora_format, keys, PREFIX), dest)
        out.append(dest)
    return out


# -- where the export goes: nothing is replaced without --overwrite ---------------------------------


def _other(args: argparse.Namespace) -> str:
    return "--diffusers another folder" if args.diffusers else "--out another path"


def _check_file(path: Path, args: argparse.Namespace) -> Path:
    """A file the export writes: refused, before any work, when it is a folder, when its folder
    is missing, or when it exists and --overwrite was not given."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder: --out names the .safetensors file to write "
                         f"(e.g. {path / 'weights.safetensors'})")
    if not path.parent.is_dir():
        what = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise FileNotFoundError(f"cannot write {path}: {path.parent} {what}")
    if (path.exists() or path.is_symlink()) and not args.overwrite:
        raise ValueError(f"{path} exists: pass --overwrite to replace it, or {_other(args)}")
    return path


def _check_lora_dirs(dirs: list[Path], args: argparse.Namespace) -> None:
    """The adapters' folders: their LoRA files must not exist yet (unless --overwrite)."""
    for d in dirs:
        if d.exists() and not d.is_dir():
            raise ValueError(f"{d} is a file: the adapters go into a folder ({d}/{WEIGHT_NAME})")
        for name in (WEIGHT_NAME, TRAINED_MODULES):
            if (d / name).exists() and not args.overwrite:
                raise ValueError(f"{d / name} exists: pass --overwrite to replace it, or {_other(args)}")


def _check_model_dirs(cfg: Any, args: argparse.Namespace) -> None:
    """--diffusers DIR for full weights: no folder may hold a model already (unless --overwrite)."""
    for d in diffusers_model_dirs(cfg, args.diffusers):
        if d.exists() and not d.is_dir():
            raise ValueError(f"{d} is a file: --diffusers names a folder")
        held = model_files(d)
        if held and not args.overwrite:
            raise ValueError(f"{d} already holds a diffusers model ({', '.join(p.name for p in held)}): pass "
                             f"--overwrite to replace it, or --diffusers another folder")


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A failed write (full disk, unwritable folder) as one line naming what was being written;
    the writers themselves leave nothing behind (dit_train/atomic.py)."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"could not write {path}: {reason}; free space, fix the folder's permissions, or "
                         f"pick another destination") from None


def _full_weights(cfg: Any, weights: Callable[[], dict], args: argparse.Namespace, default: Path) -> Path:
    """Full weights into --diffusers DIR, --out FILE or `default`. weights() computes the state
    dict once the destination was accepted: a refusal comes before the work."""
    if args.lora_format != "diffusers":
        raise ValueError(f"--lora-format {args.lora_format} writes a LoRA run's adapters; this export is full weights "
                         f"(drop --lora-format, or --merge-lora / --base)")
    if args.diffusers:
        _check_model_dirs(cfg, args)
        sd = weights()
        with _writing(Path(args.diffusers)):
            written = export_diffusers(cfg, sd, args.diffusers, overwrite=args.overwrite)
        family = model_spec(cfg.model).diffusers
        for line in family.export_notes(cfg.model) if family is not None else []:  # it loads, but not everywhere
            print(f"note: {line}")
        return written
    out = _check_file(Path(args.out) if args.out else default, args)
    sd = weights()
    with _writing(out):
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
    return _full_weights(load_config(src.parent), lambda: load_safetensors(src), args, src)


def _base(src: Path, args: argparse.Namespace) -> Path:
    """--base: the weights the run started from (no adapters)."""
    cfg = load_config(src)
    return _full_weights(cfg, lambda: initial_weights(cfg), args, src / "weights_base.safetensors")


def _from_checkpoint(ckpt: Path, args: argparse.Namespace) -> Path:
    cfg = load_config(ckpt)
    suffix = "_ema" if args.ema else ""
    if _lora(cfg, args):
        root = Path(args.out) if args.out else ckpt / f"lora{suffix}"
        dests = _lora_dests(cfg, root, args)
        _check_lora_dirs(list(dests.values()), args)
        _check_lora_format(cfg, list(dests.values()), args)
        _, model = checkpoint_model(ckpt, args.ema)
        with _writing(root if not args.diffusers else Path(args.diffusers)):
            written = [save_lora(model, out, model_spec(cfg.model).name, component=prefix)
                       for prefix, out in dests.items()]
        written = _write_lora_format(cfg, written, args)
        return written[0] if len(written) == 1 else root if not args.diffusers else Path(args.diffusers)
    return _full_weights(cfg, lambda: checkpoint_weights(ckpt, args.ema)[1], args,
                         ckpt / f"weights{suffix}.safetensors")


def _checked_adapter(path: Path) -> Path:
    """A run's LoRA file, before it is copied: it must be a readable safetensors file holding
    LoRA tensors (a file cut short, emptied or replaced is refused, not passed on)."""
    fix = "export the adapters from one of the run's checkpoints instead (train.ckpt_every > 0), if it has any"
    try:
        tensors = load_file(str(path))  # reads every tensor: a file cut short fails here
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable .safetensors file ({err}); {fix}") from None
    if not any("lora_A" in k or "lora_B" in k for k in tensors):
        raise ValueError(f"{path} holds no LoRA tensors ({len(tensors)} tensors, none named lora_A / lora_B), not the "
                         f"adapters the run wrote; {fix}")
    return path


def _checked_trained(path: Path) -> Path:
    """A run's lora/trained_modules.safetensors, before it is copied: readable, holding tensors."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        tensors, why = {}, f"not a readable .safetensors file ({err})"
    else:
        why = "it holds no tensor"
    if not tensors:
        raise ValueError(f"{path}: {why}; export from one of the run's checkpoints instead (train.ckpt_every > 0), "
                         f"if it has any")
    return path


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
    if dest is None and args.lora_format != "diffusers":  # the converted files go beside the run's own
        _check_lora_format(cfg, list(lora_dirs.values()), args)
        for src in srcs:
            _checked_adapter(src)
        written = _write_lora_format(cfg, srcs, args)
        return written[0] if len(written) == 1 else run / f"lora{suffix}"
    if dest is None:
        where = srcs[0] if len(srcs) == 1 else run / f"lora{suffix}"
        print(f"{run} has no checkpoint; its export is already at {where} (give --out or --diffusers to write it "
              f"elsewhere)")
        return None
    if _lora(cfg, args):  # the files are already in diffusers' LoRA format: DIR/pytorch_lora_weights.safetensors
        dests = _lora_dests(cfg, Path(dest), args)
        _check_lora_dirs(list(dests.values()), args)
        _check_lora_format(cfg, list(dests.values()), args)
        for src in srcs:
            _checked_adapter(src)
        # and the weights trained beside the adapters (a widened patch embedding: train_also), as save_lora writes them
        extra = {prefix: [_checked_trained(d / TRAINED_MODULES)] if (d / TRAINED_MODULES).is_file() else []
                 for prefix, d in lora_dirs.items()}
        written = []
        for prefix, out in dests.items():
            with _writing(out / WEIGHT_NAME):
                out.mkdir(parents=True, exist_ok=True)
                written.append(copy_atomic(lora_dirs[prefix] / WEIGHT_NAME, out / WEIGHT_NAME))
                for src in extra[prefix]:
                    copy_atomic(src, out / src.name)
        written = _write_lora_format(cfg, written, args)
        return written[0] if len(written) == 1 else Path(dest)
    return _full_weights(cfg, lambda: load_safetensors(srcs[0]), args, run / srcs[0].name)


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
    ap.add_argument("--lora-format", choices=lora_formats.FORMATS, default="diffusers",
                    help="LoRA runs of a diffusers family: also write the adapters as ComfyUI (comfyui) or kohya / "
                         "musubi-tuner (kohya) name them, as lora_<format>.safetensors beside the diffusers file")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace files that exist where the export goes (default: refuse, naming them)")
    args = ap.parse_args(argv)

    try:
        out, source = export(args)
    except (ValueError, OSError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out is not None:
        print(f"wrote {out} (from {source})")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
