"""LoRA adapters (peft) on our models, and their export in diffusers' LoRA format.

Injection is peft's `inject_adapter_in_model`, the lower-level API diffusers' own
`ModelMixin.add_adapter` / `load_lora_adapter` use: the model is mutated in place and keeps
its class and module tree (so `model.blocks`, FSDP2 per block, CP's `attention_fn` swap and
PackedWan's processors apply unchanged), whereas `get_peft_model` would wrap it in a PeftModel
and prefix every name with `base_model.model.`. Each targeted nn.Linear `X` becomes a
`peft.tuners.lora.Linear` holding the original layer, so parameter names change:

    X.weight, X.bias                    -> X.base_layer.weight, X.base_layer.bias (frozen)
    (new)                                  X.lora_A.default.weight [r, in]   (trainable)
    (new)                                  X.lora_B.default.weight [out, r]  (trainable)

forward: X(x) = base(x) + scaling · B(A(dropout(x))), scaling = alpha / r. Every parameter
outside the adapters is frozen (requires_grad=False), targeted or not. `plain_lora_name` maps
both kinds back to layout-free names: base weights to the original (diffusers) keys, adapters
to `X.lora_A.weight`, the key peft and diffusers use in LoRA files.

Initialisation: peft draws lora_A from torch's global RNG; `init_lora_weights_from_seed` redraws
every adapter from a generator seeded by (seed, plain name), with peft's own distribution, so
1 process and any FSDP layout (or a meta-device build) start from the same bits.

Export: `save_lora` writes `pytorch_lora_weights.safetensors` with keys
`transformer.<module>.lora_A.weight` / `.lora_B.weight` and the LoraConfig (r, lora_alpha,
target_modules) as JSON in the safetensors header `lora_adapter_metadata`, keys prefixed by
`transformer.`: what diffusers' `save_lora_weights(..., transformer_lora_adapter_metadata=...)`
writes and `WanPipeline.load_lora_weights` / `WanTransformer3DModel.load_lora_adapter` read.
Without that metadata diffusers assumes alpha = r (scale 1); `fold_scale=True` writes B·alpha/r
with lora_alpha = r instead, for loaders that ignore the header (ComfyUI and older diffusers).

No parallelism here: functions take plain models, or full (unsharded) state dicts.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from dit_train.atomic import save_file_atomic
from dit_train.models import lora_formats
from dit_train.models.params import copy_full, named_seed, plain_name
from dit_train.models.registry import MODELS, widens_pretrained

ADAPTER = "default"  # peft's adapter name: the `default` in X.lora_A.default.weight
PREFIX = "transformer"  # component prefix of diffusers' LoRA files (WanPipeline.transformer)
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
# a LoRA run's weights trained beside the adapters (LoraSettings.train_also), the transformer's own
# keys (patch_embedding.weight, ...): load them into the base with load_state_dict(strict=False)
TRAINED_MODULES = "trained_modules.safetensors"

# Linear layers adapted by default: each model's `ModelSpec.lora_targets` (models/registry.py);
# attention only, as finetrainers' Wan examples: model.lora.targets=[to_q,to_k,to_v,to_out.0] (docs/wan.md).

# peft's init_lora_weights values we accept. Both start with B = 0 (the adapted model equals the
# base at step 0) and leave the base weights alone. Not offered: pissa/olora/corda/eva/loftq
# rewrite the base weights (W - B·A) from an SVD/QR of W, so the exported adapter would only be
# valid on that modified base, and the full W must be present at injection (no meta init).
_PEFT_INIT = {"default": True, "gaussian": "gaussian"}


@dataclass
class LoraSettings:
    """rank r; alpha (None = r, i.e. scale 1); dropout on the adapter input (drawn from torch's
    global RNG: not layout invariant, keep 0 for exactness tests); targets: peft
    `target_modules`, a list of name suffixes or one regex string matched against whole names
    (None = the model's ModelSpec.lora_targets); init: "default" (A kaiming-uniform, B = 0) or
    "gaussian" (A ~ N(0, 1/r), B = 0). train_also: modules (plain names) whose own weights train
    beside the adapters, as peft's `modules_to_save` (without its copy: the module itself trains):
    a patch embedding widened with zero-initialised channels, which a frozen base would never read."""

    rank: int = 16
    alpha: float | None = None
    dropout: float = 0.0
    targets: Sequence[str] | str | None = None
    init: str = "default"
    train_also: tuple[str, ...] = ()

    def lora_config(self, model_kind: str):
        from peft import LoraConfig  # deferred: peft takes ~4 s to import (transformers); only LoRA runs need it

        if self.rank < 1:
            raise ValueError(f"lora rank={self.rank} must be >= 1")
        if self.init not in _PEFT_INIT:
            raise ValueError(f"lora init={self.init!r} must be one of {sorted(_PEFT_INIT)} (PiSSA/OLoRA-style inits "
                             f"rewrite the base weights, so the adapter would not export on its own)")
        targets = default_targets(model_kind) if self.targets is None else self.targets
        targets = targets if isinstance(targets, str) else list(targets)
        return LoraConfig(r=self.rank, lora_alpha=self.rank if self.alpha is None else self.alpha,
                          lora_dropout=self.dropout, target_modules=targets, init_lora_weights=_PEFT_INIT[self.init],
                          bias="none")


def default_targets(model_kind: str) -> tuple[str, ...] | str:
    """The LoRA targets of model `model_kind` when none are given (its ModelSpec.lora_targets)."""
    targets = MODELS[model_kind].lora_targets if model_kind in MODELS else ()
    if not targets:
        have = sorted(n for n in MODELS.names() if MODELS[n].lora_targets)
        raise ValueError(f"model kind {model_kind!r} has no default LoRA targets ({have}); give targets explicitly")
    return targets


# --------------------------------------------------------------------------- names


_ADAPTER_PART = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.")


def is_lora_name(name: str) -> bool:
    """Whether `name` (peft or plain form) is an adapter parameter."""
    return ".lora_A." in name or ".lora_B." in name


def plain_lora_name(name: str) -> str:
    """peft's parameter name -> the layout- and adapter-name-free key:
    `X.base_layer.weight` -> `X.weight` (the original model's key, e.g. diffusers'),
    `X.lora_A.default.weight` -> `X.lora_A.weight` (the key of LoRA files). Wrapper parts
    (activation checkpointing, torch.compile) are removed too; other names are unchanged."""
    return _ADAPTER_PART.sub(r".\1.", plain_name(name)).replace(".base_layer.", ".")


def in_modules(name: str, modules: Sequence[str]) -> bool:
    """Whether the parameter `name` (plain) belongs to one of `modules` (plain module names)."""
    return any(name.startswith(m + ".") for m in modules)


def trainable_names(model: nn.Module) -> list[str]:
    """Names (as in model.named_parameters()) of the parameters that require grad."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The non-adapter parameters keyed by the original model's names: what pretrained weights
    (`load_full_weights`) and per-name seeded init must address in a LoRA-wrapped model."""
    return {plain_lora_name(n): p for n, p in model.named_parameters() if not is_lora_name(n)}


# --------------------------------------------------------------------------- injection


def _config(model: nn.Module):
    config = getattr(model, "peft_config", {}).get(ADAPTER)
    if config is None:
        raise ValueError("the model has no LoRA adapter (call apply_lora first)")
    return config


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: peft LoRA layer} of every adapted layer."""
    from peft.tuners.lora import LoraLayer  # deferred: peft takes ~4 s to import (transformers); only LoRA runs need it

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def apply_lora(model: nn.Module, settings: LoraSettings, model_kind: str, seed: int | None = None) -> nn.Module:
    """Inject LoRA adapters into `model` in place (see the module docstring) and return it.

    Works on a meta-device model too (adapters are created on the base weights' device). Call it
    on the plain model, before parallelize(): FSDP2 then shards base and adapter weights of a
    block together. seed: redraw the adapters with `init_lora_weights_from_seed` (needed for
    layout-independent starts; skip it on the meta device and call it after `to_empty`).
    """
    from peft import inject_adapter_in_model  # deferred: peft takes ~4 s to import (transformers); only LoRA runs need it

    if hasattr(model, "peft_config"):
        raise ValueError("the model already has LoRA adapters")
    inject_adapter_in_model(settings.lora_config(model_kind), model, adapter_name=ADAPTER)
    # inject_adapter_in_model already froze everything outside the adapters; say so explicitly
    # (settings.train_also's modules train too)
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_name(name) or in_modules(plain_lora_name(name), settings.train_also))
    if seed is not None:
        init_lora_weights_from_seed(model, seed)
    return model


def add_frozen_adapter(model: nn.Module, settings: LoraSettings, model_kind: str, name: str) -> None:
    """A second adapter `name` (X.lora_A.<name>.weight, ...) on the layers of a model wrapped by
    `apply_lora`, frozen (requires_grad=False) and inactive: the `ADAPTER` stays the one the
    model runs and trains, until its owner switches (distill/roles.py: DMD2's critic on the
    student's base). Call it before parallelize(), like apply_lora; `init_adapters` draws it
    from the same (seed, plain name) streams as the first adapter."""
    from peft import inject_adapter_in_model  # deferred: peft takes ~4 s to import (transformers); only LoRA runs need it

    _config(model)
    configs = dict(model.peft_config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings():  # peft's "multiple adapters in the model": what this function is for
        warnings.filterwarnings("ignore", message=".*multiple adapters.*")
        inject_adapter_in_model(settings.lora_config(model_kind), model, adapter_name=name)
    model.peft_config = {**configs, **model.peft_config}  # peft's tuner kept only the new adapter's
    for layer in _lora_layers(model).values():
        layer.set_adapter(ADAPTER)  # peft's: the first adapter runs again
    for n, p in model.named_parameters():  # and only the parameters that trained before train
        p.requires_grad_(n in trainable)


@contextlib.contextmanager
def adapter_in_use(model: nn.Module, name: str | None) -> Iterator[None]:
    """Run `model` (wrapped by apply_lora, plain or sharded) with adapter `name` alone, or with
    every adapter off (None: the base); `ADAPTER` again afterwards. Sets peft's per-layer state
    (`_active_adapter`, `_disable_adapters`) directly: peft's set_adapter / enable_adapters
    would also flip requires_grad, and that decides what each optimizer, the EMA and FSDP2's
    gradient reduction hold. Enter it around a forward AND its backward (activation
    checkpointing re-runs the forward there)."""
    layers = list(_lora_layers(model).values())
    try:
        for layer in layers:
            layer._active_adapter = [name or ADAPTER]
            layer._disable_adapters = name is None
        yield
    finally:
        for layer in layers:
            layer._active_adapter = [ADAPTER]
            layer._disable_adapters = False


@torch.no_grad()
def init_lora_weights_from_seed(model: nn.Module, seed: int) -> None:
    """Redraw every adapter parameter from a generator seeded by (seed, plain_lora_name), with
    the distribution of peft's `reset_lora_parameters`: lora_A kaiming-uniform(a=√5), i.e.
    U(±1/√in), for init "default", or N(0, 1/r) for "gaussian"; lora_B zeros. Full tensors
    drawn on the CPU in fp32, then copied (a DTensor keeps its local shard): the same bits for
    any layout. Base weights are untouched."""
    init = _config(model).init_lora_weights
    for name, p in model.named_parameters():
        if not is_lora_name(name):
            continue
        key = plain_lora_name(name)
        full = torch.empty(p.shape, dtype=torch.float32)
        if ".lora_B." in key:
            full.zero_()
        else:
            gen = torch.Generator().manual_seed(named_seed(seed, key))
            if init is True:
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
            elif init == "gaussian":
                nn.init.normal_(full, std=1.0 / p.shape[0], generator=gen)
            else:
                raise ValueError(f"cannot seed init_lora_weights={init!r}")
        copy_full(p, full)


# --------------------------------------------------------------------------- export / import


def _scales(model: nn.Module, component: str = "") -> dict[str, float]:
    """{plain module name: alpha / r} of every adapted layer (under `component.`, the prefix
    removed, when given)."""
    scales = {plain_name(n): layer.scaling[ADAPTER] for n, layer in _lora_layers(model).items()}
    return _under(scales, component)


def _under(named: dict, component: str) -> dict:
    """The entries of `named` under `component.` with it removed ("" = all): one transformer's
    adapters of a model holding several (Wan 2.2 A14B's two experts, models/wan_experts.py)."""
    if not component:
        return named
    return {k[len(component) + 1:]: v for k, v in named.items() if k.startswith(component + ".")}


def lora_state_dict(model: nn.Module, model_kind: str = "wan", state_dict: dict[str, torch.Tensor] | None = None,
                    fold_scale: bool = False, component: str = "") -> dict[str, torch.Tensor]:
    """Adapter tensors in diffusers' LoRA format: `transformer.<module>.lora_A.weight` [r, in]
    and `transformer.<module>.lora_B.weight` [out, r], <module> the original module name
    (e.g. blocks.0.attn1.to_q for Wan; our DiT and LM the same under their own names: model_kind
    only checks the kind, every file uses diffusers' `transformer.` component prefix).

    The keys are peft's `get_peft_model_state_dict` keys (adapter name dropped: the peft format
    diffusers loads directly, its convert_unet_state_dict_to_peft / convert_state_dict_to_diffusers
    only translate older key styles), prefixed by the pipeline component. They are selected by
    name here rather than by that function, which matches keys against the model's module names
    and so finds nothing when the model carries activation-checkpointing or compile wrappers
    but the state dict (from get_model_state_dict) does not.
    state_dict: the full state dict of a sharded model (get_model_state_dict(..., options=
    StateDictOptions(full_state_dict=True))); None = this plain model's own. fold_scale: store
    B·alpha/r, to be read with alpha = r (see `lora_metadata`). component: only the adapters
    under this module prefix, without it (one expert of a model holding two; "" = all).
    """
    if model_kind not in MODELS:
        raise ValueError(f"model kind {model_kind!r} must be one of {sorted(MODELS.names())}")
    _config(model)
    sd = model.state_dict() if state_dict is None else state_dict
    scales = _scales(model, component)
    out = {}
    for name, value in sd.items():
        if not is_lora_name(name) or f".{ADAPTER}." not in name:
            continue
        if type(value).__name__ == "DTensor":
            raise ValueError("sharded state dict: pass get_model_state_dict(model, options=StateDictOptions("
                             "full_state_dict=True)) as state_dict")
        key = plain_lora_name(name)
        if component and not key.startswith(component + "."):
            continue
        key = key[len(component) + 1:] if component else key
        value = value.detach().cpu().contiguous()
        if fold_scale and ".lora_B." in key:
            value = value * scales[key.split(".lora_B.")[0]]
        out[f"{PREFIX}.{key}"] = value
    if len(out) != 2 * len(scales):
        raise ValueError(f"found {len(out)} adapter tensors for {len(scales)} adapted layers")
    return out


def lora_metadata(model: nn.Module, fold_scale: bool = False, component: str = "") -> dict[str, object]:
    """diffusers' adapter metadata: LoraConfig kwargs, keys prefixed `transformer.` (as its
    `_save_lora_weights` packs them; `load_lora_adapter` strips the prefix and builds
    LoraConfig(**kwargs) from them). target_modules = the exact adapted module names, so the
    adapter lands on the same layers whatever patterns chose them; lora_alpha = r if folded;
    component: those of one transformer (see `lora_state_dict`)."""
    config = _config(model)
    if config.use_rslora or config.rank_pattern or config.alpha_pattern:
        raise ValueError("export supports one rank and alpha for every layer, without rsLoRA")
    kwargs = {"r": config.r, "lora_alpha": config.r if fold_scale else config.lora_alpha,
              "target_modules": sorted(_scales(model, component)), "lora_dropout": config.lora_dropout,
              "use_dora": False, "lora_bias": False, "init_lora_weights": True}
    return {f"{PREFIX}.{k}": v for k, v in kwargs.items()}


def save_lora(model: nn.Module, out_dir: str | Path, model_kind: str = "wan",
              state_dict: dict[str, torch.Tensor] | None = None, fold_scale: bool = False,
              component: str = "") -> Path:
    """Write out_dir/pytorch_lora_weights.safetensors (lora_state_dict + lora_metadata in the
    header), loadable with `WanPipeline.load_lora_weights(out_dir)`. Returns the file.
    component: the adapters of one transformer of the model (see `lora_state_dict`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / WEIGHT_NAME
    header = {"format": "pt", METADATA_KEY: json.dumps(lora_metadata(model, fold_scale, component), sort_keys=True)}
    # atomic: a reader never sees half a file, a failed write leaves no stray temporary one
    save_file_atomic(lora_state_dict(model, model_kind, state_dict, fold_scale, component), path, metadata=header)
    trained = trained_modules_state(model, state_dict, component)
    if trained:  # settings.train_also's weights: not LoRA tensors, so beside the LoRA file
        save_file_atomic(trained, out_dir / TRAINED_MODULES)
    return path


def trained_modules_state(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None,
                          component: str = "") -> dict[str, torch.Tensor]:
    """{plain name: tensor} of the trainable parameters outside the adapters (LoraSettings.train_also:
    a widened patch embedding), under `component` without its prefix; {} for a plain LoRA run."""
    sd = model.state_dict() if state_dict is None else state_dict
    names = {plain_lora_name(n) for n, p in model.named_parameters() if p.requires_grad and not is_lora_name(n)}
    out = {}
    for name, value in sd.items():
        key = plain_lora_name(name)
        if key in names and (not component or key.startswith(component + ".")):
            out[key[len(component) + 1:] if component else key] = value.detach().cpu().contiguous()
    return out


@torch.no_grad()
def load_lora(model: nn.Module, path: str | Path, model_kind: str = "wan") -> None:
    """Load a LoRA file into a model wrapped by apply_lora, plain or sharded (each rank reads the
    file and keeps its shards): one written by `save_lora` or another diffusers LoRA file with the
    same adapted layers and rank (its scale: lora_alpha/r of its metadata; 1 without, as diffusers
    assumes), or a LoRA in ComfyUI's or kohya / musubi-tuner's layout under the key map of model
    `model_kind`'s family (models/lora_formats.py; its `.alpha` tensors, scale 1 without). The
    file's scale is converted to the model's by rescaling B."""
    with safe_open(str(path), "pt") as f:
        header = json.loads((f.metadata() or {}).get(METADATA_KEY, "{}"))
    config = _config(model)
    sd, alpha = load_file(str(path)), None
    if lora_formats.is_converted(sd):
        modules = {plain_lora_name(n).split(".lora_")[0] for n, _ in model.named_parameters() if is_lora_name(n)}
        sd, alpha = lora_formats.to_diffusers(sd, lora_formats.key_map(MODELS[model_kind]), modules, PREFIX)
    rank = next((v.shape[0] for k, v in sd.items() if ".lora_A." in k), config.r)
    r = header.get(f"{PREFIX}.r", rank)
    if r != config.r:
        raise ValueError(f"LoRA file {path} has rank {r}, the model's adapters rank {config.r}")
    alpha = header.get(f"{PREFIX}.lora_alpha", r) if alpha is None else alpha
    file_scale = alpha / r
    params = {plain_lora_name(n): p for n, p in model.named_parameters() if is_lora_name(n)}
    sd = {k.removeprefix(f"{PREFIX}."): v for k, v in sd.items()}
    missing, unexpected = sorted(params.keys() - sd.keys()), sorted(sd.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"LoRA file {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    scales = _scales(model)
    for key, p in params.items():
        value = sd[key]
        if ".lora_B." in key:
            value = value * (file_scale / scales[key.split(".lora_B.")[0]])
        copy_full(p, value)


# --------------------------------------------------------------------------- merge


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """A copy of the LoRA-wrapped plain `model` with each adapter merged into its base weight by
    peft (`LoraLayer.merge`: W += scaling · B @ A) and each peft layer replaced by that base
    nn.Linear: no peft left, the original state-dict keys, same function. The input model is
    unchanged. For a sharded model: load its full state dict into a plain model wrapped by
    apply_lora with the same settings, then merge that."""
    _config(model)
    merged = copy.deepcopy(model)
    for name, layer in list(_lora_layers(merged).items()):
        layer.merge(safe_merge=True, adapter_names=[ADAPTER])
        parent_name, _, child = name.rpartition(".")
        parent = merged.get_submodule(parent_name) if parent_name else merged
        setattr(parent, child, layer.get_base_layer())
    del merged.peft_config
    for p in merged.parameters():
        p.requires_grad_(True)
    return merged


@torch.no_grad()
def merged_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped model's full state dict (peft names, e.g. from full_state_dict) -> the
    plain model's weights with every adapter merged: W = W_base + (alpha/r)·B @ A under the
    original keys. Tensor math on the state dict alone (no model copy), so it also serves
    sharded models whose full state dict was gathered."""
    scales = _scales(model)
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if is_lora_name(name):
            continue
        out[plain_lora_name(name)] = value
    for module, scale in scales.items():
        a = state_dict[f"{module}.lora_A.{ADAPTER}.weight"].float()
        b = state_dict[f"{module}.lora_B.{ADAPTER}.weight"].float()
        key = f"{module}.weight"
        out[key] = (out[key].float() + scale * (b @ a)).to(out[key].dtype)
    return out


def settings_from(rank: int, alpha: float, dropout: float, targets: Sequence[str], init: str) -> LoraSettings:
    """LoraSettings from the config's keys (alpha 0 = rank; targets [] = the model's default set)."""
    return LoraSettings(rank=rank, alpha=alpha or None, dropout=dropout, targets=list(targets) or None, init=init)


def lora_settings(model_cfg: Any) -> LoraSettings | None:
    """LoraSettings of `model.lora`, or None when model.lora.rank = 0 (full training)."""
    lo = model_cfg.lora
    if lo.rank <= 0:
        return None
    settings = settings_from(lo.rank, lo.alpha, lo.dropout, lo.targets, lo.init)
    if widens_pretrained(model_cfg):  # e.g. a Wan T2V checkpoint given new input channels
        settings.train_also = ("patch_embedding",)
    return settings
