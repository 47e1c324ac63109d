"""`model.pretrained` for our DiT (model=dit): start a run — typically a LoRA fine-tune — from the
weights of a finished dit_train run.

model.pretrained is either a run folder (its EMA weights, weights_ema.safetensors, when it has
them, else weights.safetensors: what a run writes at its end, or `tools.export_weights` from a
checkpoint) or one .safetensors file of full weights under the plain model's names. Only
safetensors are read (never a pickle).

Checked before any worker starts (`errors`, one line): the file exists, and every tensor's name
and shape equal the configured model's (read from the file's header, no tensor loaded), so a
run of another width, depth, patch or caption size is refused, naming the first differing key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

RUN_FILES = ("weights_ema.safetensors", "weights.safetensors")  # a run folder's, first present wins


def weights_file(path: str) -> Path:
    """The file model.pretrained=`path` names (FileNotFoundError with what to do, else)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        for name in RUN_FILES:
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"{p} holds no {' or '.join(RUN_FILES)} (a run writes them at its end; export a "
                                f"checkpoint's with python -m dit_train.tools.export_weights {p})")
    raise FileNotFoundError(f"{p} does not exist: give a dit_train run folder or a .safetensors file")


def read(cfg: Any) -> dict[str, torch.Tensor]:
    """ModelSpec.pretrained: the full fp32 state dict model.pretrained names."""
    return {k: v.float() for k, v in load_file(str(weights_file(cfg.pretrained))).items()}


def errors(cfg: Any, build: Callable[[], nn.Module]) -> list[str]:
    """model.pretrained against the model `build()` makes (called on the meta device): one line
    on a missing file, an unreadable one, or the first name or shape that differs."""
    if not cfg.pretrained:
        return []
    where = f"model.pretrained={cfg.pretrained}"
    try:
        path = weights_file(cfg.pretrained)
        with safe_open(str(path), framework="pt") as f:
            got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except FileNotFoundError as err:
        return [f"{where}: {err}"]
    except Exception as err:  # noqa: BLE001 - not a safetensors file: one line, not a traceback
        return [f"{where}: cannot read it as safetensors ({type(err).__name__}: {str(err)[:120]})"]
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in build().state_dict().items()}
    bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    if not bad:
        return []
    k = bad[0]
    return [f"{where}: {path.name} does not fit the configured model ({len(bad)} tensor(s) differ; first {k}: weights "
            f"{got.get(k, 'absent')}, model {want.get(k, 'absent')}); set model.dim / depth / heads / patch_size / "
            f"text_dim as the run that wrote it had them (its config.yaml)"]
