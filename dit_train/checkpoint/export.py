"""Full weights out of a run: safetensors (any layout, one process) and diffusers folders."""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from dit_train.atomic import save_file_atomic, temporary_name
from dit_train.checkpoint import safe_load
from dit_train.checkpoint.store import find_checkpoint, read_checkpoint_info
from dit_train.compose import load_config
from dit_train.models import build_model, model_spec
from dit_train.models.registry import component_state
from dit_train.models.init import init_adapters, initialize, load_full_weights
from dit_train.models.lora import apply_lora, lora_settings, merged_state_dict, plain_lora_name, save_lora
from dit_train.models.quant import is_quantized


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU state dict; a collective under FSDP (every rank must call it).

    Keys are those of the plain model: wrapper prefixes (DDP `module.`, activation
    checkpointing, torch.compile) are removed by torch.distributed.checkpoint. A quantized base
    weight (model.base_quant) is returned as it is, for `with_base` to replace: torchao's
    NF4Tensor refuses `.to(copy=True)`, and no caller needs a copy of one.
    """
    # deferred: DCP imports torch.distributed.tensor (~1.8 s at every start, --help and refusals too)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v if is_quantized(v) else v.detach().to(torch.float32, copy=True).contiguous() for k, v in sd.items()}


def save_safetensors(sd: dict[str, torch.Tensor], path: str | Path) -> None:
    """Atomic (dit_train/atomic.py): a reader never sees half a file, a failed write leaves
    neither a half file nor a stray temporary one."""
    save_file_atomic(sd, path)


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file; a file that is not one (cut short, another format)
    is a ValueError naming it, not the reader's own error."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable .safetensors file ({err}); export the weights again "
                         f"(python -m dit_train.tools.export_weights) or point at another file") from None


def export_weights(model: nn.Module, path: str | Path, is_main: bool) -> None:
    sd = full_state_dict(model)
    if is_main:
        save_safetensors(sd, path)


def export_run_weights(model: nn.Module, ema: Any, model_cfg: Any, run_dir: str | Path, is_main: bool,
                       base: Any = None) -> list[Path]:
    """What a finished run writes (every rank calls it: gathering shards is a collective):

    weights.safetensors (and weights_ema.safetensors with EMA): the plain model's full fp32
    weights — for a LoRA run the base with the adapters merged in, so every tool loads it like
    any run's; and for LoRA runs lora/pytorch_lora_weights.safetensors (lora_ema/ for the EMA
    adapters) in diffusers' LoRA format, loadable by WanPipeline.load_lora_weights — one file per
    diffusers transformer of the model (`run_lora_dirs`: Wan 2.2 A14B's two experts of a
    model.expert=both run in lora/transformer/ and lora/transformer_2/).
    base: a callable giving the full-precision base weights (plain names) for a run whose model
    does not hold them (model.base_quant: quantized, model.block_swap: in host memory): the merged
    weights are that base plus the adapters, as `--merge-lora` exports them."""
    run_dir = Path(run_dir)
    full = full_state_dict(model)
    if base is not None and is_main:
        full = with_base(full, base())
    ema_sd = ema.full_state_dict() if ema is not None else None
    if not is_main:
        return []
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = []
    for suffix, sd in (("", full), ("_ema", None if ema_sd is None else {**full, **ema_sd})):
        if sd is None:
            continue
        if hasattr(inner, "peft_config"):
            for prefix, sub in run_lora_dirs(model_cfg, run_dir / f"lora{suffix}").items():
                out.append(save_lora(inner, sub, model_spec(model_cfg).name, state_dict=sd, component=prefix))
            sd = merged_state_dict(inner, sd)
        save_safetensors(sd, run_dir / f"weights{suffix}.safetensors")
        out.append(run_dir / f"weights{suffix}.safetensors")
    return out


def with_base(sd: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` (a LoRA model's full state dict, peft names) with every frozen base entry the model
    could not give as a plain full tensor — a torchao quantized weight, a block-swap placeholder
    (0 elements) — replaced by `base`'s (plain names)."""
    out = dict(sd)
    for name, value in sd.items():
        key = plain_lora_name(name)
        if key in base and (is_quantized(value) or value.numel() != base[key].numel()):
            out[name] = base[key]
    return out


def run_lora_dirs(model_cfg: Any, root: str | Path) -> dict[str, Path]:
    """{state-dict prefix: folder of its LoRA file} under a run's lora/ (or lora_ema/): root
    itself for a model of one transformer, root/<component> for each of several."""
    parts = model_spec(model_cfg).components(model_cfg)
    return {prefix: Path(root) / (sub if prefix else "") for prefix, sub in parts.items()}


def initialize_run_model(model: nn.Module, cfg: Any) -> None:
    """A run's starting weights in one process: a distillation run's teacher's (distill.teacher:
    that run's weights, EMA when present, read again, so its folder must still be there: a LoRA
    distillation's frozen base), else `initialize` (model.pretrained or train.seed); LoRA
    adapters, if any, from the seed."""
    if getattr(cfg, "distill", None) is not None and cfg.distill.method != "none" and cfg.distill.teacher:
        load_full_weights(model, run_weights(Path(cfg.distill.teacher), None)[0])
        init_adapters(model, cfg.train.seed)
    else:
        initialize(model, cfg.model, cfg.train.seed)


def initial_weights(cfg: Any) -> dict[str, torch.Tensor]:
    """The full fp32 weights a run started from, in one process: `model.pretrained`'s when set,
    a distillation's teacher's, else the initialisation from `train.seed` (the same bits on every
    layout). For a LoRA run this is the frozen base its adapters apply to."""
    model = build_model(cfg.model)  # without adapters: model.lora is applied by the run's builder
    initialize_run_model(model, cfg)
    return {k: v.float().contiguous() for k, v in model.state_dict().items()}


def checkpoint_model(path: str | Path, ema: bool = False) -> tuple[Any, nn.Module]:
    """(Config, the plain model as trained) of a checkpoint, in one process (no GPU, no process
    group). LoRA runs: the base from its own initialisation (pretrained folder, seed, or a
    distillation's teacher) with the checkpoint's adapters injected (a LoRA distillation's
    student: peft's `default` adapter; its critic adapter is left in the checkpoint). ema: the
    EMA weights instead (train.ema_decay > 0)."""
    path = Path(path)
    cfg = load_config(path)
    model = build_model(cfg.model)
    lora = lora_settings(cfg.model)
    if lora is not None:
        apply_lora(model, lora, model_spec(cfg.model).name)
        initialize_run_model(model, cfg)  # the frozen base is not in the checkpoint
    if ema and "ema" not in read_checkpoint_info(path)["sharded"]:
        raise ValueError(f"checkpoint {path} holds no EMA weights (it was trained with train.ema_decay=0)")
    trained = {plain_lora_name(n) for n, p in model.named_parameters() if p.requires_grad}  # adapters (+ train_also)
    sd = {k: v for k, v in model.state_dict().items() if lora is None or plain_lora_name(k) in trained}
    state = {"ema": {"shadow": sd}} if ema else {"model": sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        safe_load.load(state, path)
    model.load_state_dict(sd, strict=lora is None)
    return cfg, model


def checkpoint_weights(path: str | Path, ema: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """(Config, full fp32 weights of the plain model) of a checkpoint, in one process; LoRA runs
    give the base with the adapters merged in (the same keys as a full-training run)."""
    cfg, model = checkpoint_model(path, ema)
    sd = model.state_dict()
    if hasattr(model, "peft_config"):
        sd = merged_state_dict(model, sd)
    return cfg, {k: v.float().contiguous() for k, v in sd.items()}


def export_checkpoint(path: str | Path, out: str | Path, ema: bool = False) -> Path:
    """Full weights (or EMA weights) of a checkpoint as safetensors, in one process."""
    _, sd = checkpoint_weights(path, ema)
    save_safetensors(sd, out)
    return Path(out)


DIFFUSERS_MODEL_FILES = ("config.json", "diffusion_pytorch_model*")  # what save_pretrained writes (shards too)


def diffusers_model_dirs(cfg: Any, out_dir: str | Path) -> list[Path]:
    """The model folders `export_diffusers` writes: out_dir itself, or each transformer's pipeline
    component (an A14B expert's subfolder)."""
    return [Path(out_dir) / sub for sub in model_spec(cfg.model).components(cfg.model).values()]


def model_files(folder: Path) -> list[Path]:
    """The diffusers model files (config.json, diffusion_pytorch_model*) already in `folder`."""
    return sorted(p for pattern in DIFFUSERS_MODEL_FILES for p in folder.glob(pattern)) if folder.is_dir() else []


def _save_pretrained(model: Any, dest: Path, overwrite: bool) -> None:
    """model.save_pretrained(dest) without a half-written or mixed folder: saved into a temporary
    folder beside dest, then its files renamed in (with overwrite, the old model files go first:
    a smaller new model must not keep the old one's extra shards). Other files in dest (a LoRA
    file, a README) stay. A failure removes the temporary folder and leaves dest as it was."""
    old = model_files(dest)
    if old and not overwrite:
        raise FileExistsError(f"{dest} already holds a diffusers model ({', '.join(p.name for p in old)})")
    stage = temporary_name(dest)
    try:
        model.save_pretrained(str(stage))
        dest.mkdir(parents=True, exist_ok=True)
        for p in old:
            p.unlink()
        for p in stage.iterdir():
            os.replace(p, dest / p.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def export_diffusers(cfg: Any, state_dict: dict[str, torch.Tensor], out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write full weights as a diffusers model folder (`save_pretrained`: config.json +
    safetensors), loadable with `from_pretrained`, for models whose spec can (model.name=wan);
    each transformer of the model into its pipeline component (an A14B expert's subfolder).
    A folder already holding a model is refused (FileExistsError) unless `overwrite`.
    Returns the folder written (out_dir itself when the model holds several)."""
    spec = model_spec(cfg.model)
    if spec.to_diffusers is None:
        raise ValueError(f"--diffusers exports models with a diffusers counterpart (model.name=wan); "
                         f"this run is model.name={cfg.model.name}")
    parts = spec.components(cfg.model)
    for prefix, sub in parts.items():
        _save_pretrained(spec.to_diffusers(component_state(state_dict, prefix), cfg.model), Path(out_dir) / sub,
                         overwrite)
    return Path(out_dir) / next(iter(parts.values())) if len(parts) == 1 else Path(out_dir)


def weights_source(run_dir: Path, ema: bool | None) -> Path:
    """Where run_weights reads a run's weights: an exported file, else the newest checkpoint's folder."""
    files = {True: run_dir / "weights_ema.safetensors", False: run_dir / "weights.safetensors"}
    want = [ema] if ema is not None else [True, False]
    for choice in want:
        if files[choice].is_file():
            return files[choice]
    ckpt = find_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir} has no {' or '.join(files[c].name for c in want)} and no checkpoint")
    return ckpt


def run_weights(run_dir: Path, ema: bool | None) -> tuple[dict, str]:
    """(full state dict, description) of a run: exported files first, else its newest checkpoint.
    ema: True = the EMA weights (error if none), False = training weights, None = EMA if present."""
    source = weights_source(run_dir, ema)
    if source.is_file():
        return load_safetensors(source), source.name
    ckpt, want = source, [ema] if ema is not None else [True, False]
    for choice in want:
        try:
            return checkpoint_weights(ckpt, ema=choice)[1], f"{ckpt} ({'EMA' if choice else 'training'} weights)"
        except ValueError:
            if ema is not None:
                raise
    raise FileNotFoundError(f"no usable weights in {ckpt}")
