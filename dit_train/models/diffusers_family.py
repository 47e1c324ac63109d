"""One description per diffusers transformer family, and everything built from it.

A family's packed model holds the diffusers model's submodules under their own names, so our
state dict IS the diffusers state dict (the key mapping is the identity): a pretrained folder
loads 1:1 and an export saves 1:1. What differs between families is only data: the diffusers
class, how our config maps onto its config.json (`kwargs`, `our_keys`), the keys our packed
forward assumes (`fixed`), and which folder of a pipeline holds it (`folders`). From that,
`DiffusersFamily` gives:

- `mismatch(path, cfg)`: what in the folder does not fit, from config.json alone (no weights
  read), so `engine/checks.py` refuses a folder of another family or size in one `error:` line
  before any worker starts;
- `read(path, cfg)`: the folder's fp32 state dict, after the same check;
- `to_diffusers(state_dict, cfg)`: the diffusers module holding a state dict (export);
- `checks(cfg)`: the spec's pre-run checks (shape, then the folder);
- `spec(...)`: the family's `ModelSpec` with those wired in.

No parallelism here, and no weights are read by the checks.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dit_train.models.lora_formats import KeyMap
from dit_train.models.registry import model_spec, ModelSpec, no_checks

log = logging.getLogger(__name__)


def transformer_folder(path: str, class_name: str, sub: str = "transformer") -> Path:
    """The folder holding the transformer's config.json: `path`, or `path/<sub>` of a pipeline
    folder (FileNotFoundError naming what was expected)."""
    folder = Path(path).expanduser()
    if (folder / "config.json").exists():
        return folder
    if (folder / sub / "config.json").exists():
        return folder / sub  # a whole pipeline folder: its transformer
    raise FileNotFoundError(f"model.pretrained={path}: no config.json there (expected a diffusers {class_name} "
                            f"folder, or a pipeline folder with {sub}/)")


def _nothing(*args: Any) -> list[str]:
    return []


def _plain(value: Any) -> Any:
    """A config value as compared: JSON's lists and our tuples alike."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _shown(value: Any) -> Any:
    """A config value as an error message shows it: sequences as JSON lists."""
    return list(value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class DiffusersFamily:
    """What dit_train needs to know about one diffusers transformer class (module docstring)."""

    class_name: str  # the diffusers class, e.g. "WanTransformer3DModel"
    kwargs: Callable[[Any], dict[str, Any]]  # class(**kwargs(cfg)) has cfg's shape; ValueError naming the key
    our_keys: dict[str, str]  # config.json key -> our config key(s) that set it (only these are compared)
    fixed: dict[str, Any] = field(default_factory=dict)  # config.json keys our packed forward assumes
    # how the refusal of another family's folder names a folder of this one ("an LTX-Video folder")
    folder_kind: str = ""
    article: str = "a"  # "a" / "an" before class_name in messages
    # (path, cfg) -> {state-dict prefix: folder holding config.json} ("" = the whole state dict):
    # the transformer's folder, a pipeline's transformer/, or Wan 2.2 A14B's expert subfolders.
    # Raises FileNotFoundError / ValueError naming what is missing
    folders: Callable[[str, Any], dict[str, Path]] | None = None
    # (config.json, cfg, path) -> a refusal of the folder as a whole, before its class and keys are
    # compared (Wan VACE: a plain Wan folder's VACE blocks would be untrained); [] = none
    refuse: Callable[[dict, Any, str], list[str]] = _nothing
    # (config.json, our kwargs) -> more lines for the list of what differs (Wan's CLIP image branch)
    notes: Callable[[dict, dict], list[str]] = _nothing
    # cfg -> lines a --diffusers export prints after writing the folder: what it cannot be used for
    # although it loads (LTX-2: not LTX2Pipeline's transformer unless patch 1); [] = none
    export_notes: Callable[[Any], list[str]] = _nothing
    # state-dict key of a Conv3d input weight [dim, C, pt, ph, pw] that a text-to-video folder may be
    # widened into for cond.feed=concat (new channels start at zero: `widen`); "" = never
    widen_key: str = ""
    # the family's LoRA module names in its original checkpoint, as ComfyUI and kohya / musubi-tuner
    # files use them (models/lora_formats.KeyMap, with where they were read); None = not read
    lora_keys: KeyMap | None = None

    # ------------------------------------------------------------------ folders and checks

    def model_class(self) -> type:
        """The diffusers class."""
        import diffusers  # deferred: diffusers takes ~2 s to import; only runs of a diffusers family need it

        return getattr(diffusers, self.class_name)

    def module(self, cfg: Any) -> nn.Module:
        """A fresh diffusers module of cfg's shape (the packed model takes over its submodules)."""
        return self.model_class()(**self.kwargs(cfg))

    def resolve(self, path: str, cfg: Any) -> dict[str, Path]:
        """{state-dict prefix: folder} the folder `path` gives for `cfg` (see `folders`)."""
        if self.folders is not None:
            return self.folders(path, cfg)
        return {"": transformer_folder(path, self.class_name)}

    def widening(self, theirs: dict, cfg: Any) -> int:
        """Input channels a text-to-video folder (config.json `theirs`) is widened by for this run:
        cond.feed=concat or cond.control on a folder that reads in_channels only; 0 = none."""
        if not self.widen_key:
            return 0
        extra = self.kwargs(cfg)["in_channels"] - cfg.in_channels
        return extra if extra > 0 and theirs.get("in_channels") == cfg.in_channels else 0

    def problems(self, theirs: dict, cfg: Any, path: str) -> list[str]:
        """What in the config.json `theirs` does not fit `cfg`, in one line ([] = it fits): a refusal,
        a model of another class, or each key that differs with the value ours gives. A key the
        file does not hold counts as ours."""
        refusal = self.refuse(theirs, cfg, path)
        if refusal:
            return refusal
        held = theirs.get("_class_name", "")
        if held != self.class_name:
            return [f"model.pretrained={path} holds a {held or 'model without _class_name'}, not {self.article} "
                    f"{self.class_name} (model.name={cfg.name}): choose the model preset of its family, or "
                    f"{self.folder_kind}"]
        want = self.kwargs(cfg)
        if self.widening(theirs, cfg):  # its input widens (`read`): the folder's own channels are the run's
            want["in_channels"] = cfg.in_channels
        wrong = [f"{key}={_shown(theirs.get(key))} (model.{self.our_keys[key]} gives {_shown(ours)})"
                 for key, ours in want.items() if key in self.our_keys and _plain(theirs.get(key, ours)) != _plain(ours)]
        wrong += [f"{key}={theirs[key]} (only {fixed!r} is supported)" for key, fixed in self.fixed.items()
                  if theirs.get(key, fixed) != fixed]
        wrong += self.notes(theirs, want)
        return [f"model.pretrained={path} does not match the model config: " + "; ".join(wrong)] if wrong else []

    def mismatch(self, path: str, cfg: Any) -> list[str]:
        """What in the folder `path` does not fit `cfg`, from its config.json alone (no weights
        read): a missing config.json, a model of another family or size. [] = it fits."""
        try:
            folders = self.resolve(path, cfg)
        except (FileNotFoundError, ValueError) as err:
            return [str(err)]
        for folder in folders.values():
            problems = self.problems(json.loads((folder / "config.json").read_text()), cfg, path)
            if problems:
                return problems
        return []

    def checks(self, cfg: Any, own: Callable[[Any], list[str]] = no_checks) -> list[str]:
        """ModelSpec.checks: the family's `own` checks, the shape (kwargs), then a model.pretrained
        folder that does not fit — before the run starts (a path that is not a folder is said by
        engine/checks.py)."""
        errors = list(own(cfg))
        try:
            self.kwargs(cfg)
        except ValueError as err:
            return errors + [str(err)]
        if cfg.pretrained and Path(cfg.pretrained).expanduser().is_dir():
            errors += self.mismatch(cfg.pretrained, cfg)
        return errors

    # ------------------------------------------------------------------ weights

    def read(self, path: str, cfg: Any) -> dict[str, torch.Tensor]:
        """fp32 CPU state dict of the diffusers folder `path`, after `mismatch`'s check (ValueError
        with its line; a missing config.json is FileNotFoundError): each component's keys under its
        prefix (Wan 2.2 A14B both experts: transformer. / transformer_2.)."""
        folders = self.resolve(path, cfg)
        configs = {prefix: json.loads((folder / "config.json").read_text()) for prefix, folder in folders.items()}
        for theirs in configs.values():
            problems = self.problems(theirs, cfg, path)
            if problems:
                raise ValueError(problems[0])
        state = {}
        for prefix, folder in folders.items():
            part = self._load(folder, path, cfg)
            extra = self.widening(configs[prefix], cfg)
            part = widen(part, self.widen_key, extra) if extra else part
            state |= {f"{prefix}.{k}" if prefix else k: v for k, v in part.items()}
        return state

    def _load(self, folder: Path, path: str, cfg: Any) -> dict[str, torch.Tensor]:
        try:
            model = self.model_class().from_pretrained(str(folder), torch_dtype=torch.float32,
                                                       use_safetensors=not cfg.allow_pickle_weights)
        except EnvironmentError as err:
            raise ValueError(f"model.pretrained={path}: {err} (weights must be .safetensors; "
                             f"model.allow_pickle_weights=true also reads .bin from a source you trust)") from None
        return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}

    def widens(self, cfg: Any) -> bool:
        """model.pretrained's input gets this run's new channels (`widen`); LoRA then trains it beside
        the adapters (models/lora.py). False without a folder or when its config cannot be read (the
        checks say why)."""
        if not (self.widen_key and cfg.pretrained):
            return False
        try:
            folders = self.resolve(cfg.pretrained, cfg)
            return all(self.widening(json.loads((f / "config.json").read_text()), cfg) for f in folders.values())
        except (OSError, ValueError, KeyError):
            return False

    def to_diffusers(self, state_dict: dict[str, torch.Tensor], cfg: Any) -> nn.Module:
        """A diffusers module of cfg's shape holding `state_dict` (our keys = diffusers' keys)."""
        model = self.module(cfg)
        model.load_state_dict(state_dict, strict=True)
        return model

    def spec(self, checks: Callable[[Any], list[str]] = no_checks, **fields: Any) -> ModelSpec:
        """The family's ModelSpec: `fields`, with checks (its own `checks` first), pretrained and
        to_diffusers built from this description."""
        return ModelSpec(checks=lambda cfg: self.checks(cfg, checks), pretrained=lambda cfg: self.read(cfg.pretrained, cfg),
                         to_diffusers=self.to_diffusers, diffusers=self, **fields)


def widen(state: dict[str, torch.Tensor], key: str, extra: int) -> dict[str, torch.Tensor]:
    """A text-to-video state dict for a model whose input weight `key` [dim, C, pt, ph, pw] reads
    `extra` more input channels (cond.feed=concat: mask and conditioning frames, after the noisy
    ones): the new channels' weights start at zero, so the widened model computes exactly what the
    T2V one did until training teaches it to read them (as diffusers-based I2V fine-tuning does)."""
    w = state[key]
    log.info("model.pretrained: %s gets %d zero-initialised input channels (cond.feed=concat)", key, extra)
    return state | {key: torch.cat([w, w.new_zeros(w.shape[0], extra, *w.shape[2:])], dim=1)}


def family_of(cfg: Any) -> DiffusersFamily:
    """The diffusers family of a model config (ValueError for a model that is not one)."""
    family = model_spec(cfg).diffusers
    if family is None:
        raise ValueError(f"model.name={cfg.name} is not a diffusers family (no folders to read or export)")
    return family


def read_pretrained(path: str, cfg: Any) -> dict[str, torch.Tensor]:
    """fp32 CPU state dict of the diffusers folder `path` for the model config `cfg` (its family's `read`)."""
    return family_of(cfg).read(path, cfg)


def to_diffusers(state_dict: dict[str, torch.Tensor], cfg: Any) -> nn.Module:
    """The diffusers module of `cfg`'s family holding `state_dict`."""
    return family_of(cfg).to_diffusers(state_dict, cfg)
