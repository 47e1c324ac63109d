"""LoRA files for the tools people load video LoRAs in: ComfyUI and kohya / musubi-tuner.

Our LoRA files are diffusers' (models/lora.py): `transformer.<diffusers module>.lora_A.weight`
[r, in] / `.lora_B.weight` [out, r], alpha in the header's adapter metadata. ComfyUI and
musubi-tuner name a module as the family's original checkpoint does (Wan: blocks.N.self_attn.q;
HunyuanVideo 1.5: double_blocks.N.img_attn_q; LTX: the diffusers names inside the blocks): ComfyUI
keys a LoRA by its own model's state-dict names (comfy/lora.py `model_lora_keys_unet`: every
`diffusion_model.<key>.weight` answers to `diffusion_model.<key>` and to `lora_unet_<key with . -> _>`).
Each family owns its `KeyMap` (diffusers name -> original name), beside its DiffusersFamily in its
model file, with where its names were read; this module holds the mechanics. Two layouts:

    comfyui   diffusion_model.<orig>.lora_A.weight, .lora_B.weight, diffusion_model.<orig>.alpha
              (musubi-tuner's convert_lora.py "other" format, "Diffusers/ComfyUI")
    kohya     lora_unet_<orig, "." -> "_">.lora_down.weight, .lora_up.weight, .alpha
              (musubi-tuner's / sd-scripts' native format)

alpha is a 0-d float32 tensor per module, the value ComfyUI (`lora[alpha_name].item()`; without
one its scale is 1) and diffusers' Wan converters read: the weight delta is alpha / r · up @ down,
as in training. A family whose diffusers reader drops `.alpha` (LTX-Video, LTX-2: their converters
only rename keys, and peft then takes alpha = r) has `KeyMap.alpha = False`: alpha / r is folded
into up and no alpha is written, which every reader takes as scale 1 — the same delta everywhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

FORMATS = ("diffusers", "comfyui", "kohya")
_BLOCK = re.compile(r"^([a-z_]+)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class KeyMap:
    """One family's diffusers module names -> its original checkpoint's (ComfyUI's, kohya's).

    blocks: {diffusers block list: (original list name, {suffix inside a block: original suffix},
    or None where every module inside keeps its name)}; top: modules outside the blocks;
    unmapped: why any other module has no name here (the refusal says it). alpha: write `.alpha`
    tensors (False: fold alpha / r into up, see the module docstring)."""

    family: str
    blocks: dict[str, tuple[str, dict[str, str] | None]]
    top: dict[str, str] = field(default_factory=dict)
    alpha: bool = True
    unmapped: str = ""

    def original(self, module: str) -> str:
        """A diffusers module name -> the original checkpoint's (ValueError in one line when unmapped)."""
        m = _BLOCK.match(module)
        if m and m.group(1) in self.blocks:
            theirs, inner = self.blocks[m.group(1)]
            if inner is None or m.group(3) in inner:
                return f"{theirs}.{m.group(2)}.{m.group(3) if inner is None else inner[m.group(3)]}"
        if module in self.top:
            return self.top[module]
        why = f" ({self.unmapped})" if self.unmapped else ""
        raise ValueError(f"no ComfyUI / kohya name known for the {self.family} module {module!r}{why}; "
                         f"export it with --lora-format diffusers")

    def with_blocks(self, **blocks: tuple[str, dict[str, str] | None]) -> "KeyMap":
        """This map with more block lists (Wan VACE: Wan's plus its vace_blocks)."""
        return replace(self, blocks=self.blocks | blocks)


def key_map(spec: Any) -> KeyMap:
    """The KeyMap of a model (its ModelSpec): its diffusers family's; ValueError in one line for a
    model no ComfyUI / kohya tool loads (our DiT, the LM) or a family whose names were not read."""
    family = spec.diffusers
    if family is None:
        raise ValueError(f"model={spec.name} is dit_train's own model: no ComfyUI or kohya / musubi-tuner loader "
                         f"exists for it (they load the families they implement), so there are no names to write; "
                         f"its LoRA file is diffusers' format (--lora-format diffusers), which model.lora.init_from "
                         f"and diffusers' load_lora_adapter read")
    if family.lora_keys is None:
        raise ValueError(f"model={spec.name}: the ComfyUI / kohya key map of {family.class_name} was not read "
                         f"here; use --lora-format diffusers")
    return family.lora_keys


def _parts(key: str, prefix: str) -> tuple[str, str]:
    """`<prefix>.<module>.lora_A.weight` -> (module, "A" | "B")."""
    module, _, kind = key.removeprefix(prefix + ".").rpartition(".lora_")
    if kind not in ("A.weight", "B.weight"):
        raise ValueError(f"{key} is not a LoRA tensor (X.lora_A.weight / X.lora_B.weight)")
    return module, kind[0]


def convert(sd: dict[str, torch.Tensor], alpha: float, fmt: str, keys: KeyMap,
            prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """Our diffusers LoRA tensors (`<prefix>.<module>.lora_A.weight` / `.lora_B.weight`, one alpha
    for every module, unfolded: delta = alpha / r · B @ A) -> the same adapters in `fmt` (comfyui |
    kohya) under `keys`' names. Tensors pass unchanged, except up · alpha / r where keys.alpha is False."""
    if fmt == "diffusers":
        return dict(sd)
    if fmt not in FORMATS:
        raise ValueError(f"--lora-format {fmt!r} must be one of {', '.join(FORMATS)}")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        module, ab = _parts(key, prefix)
        orig = keys.original(module)
        if not keys.alpha and ab == "B":
            value = value * (alpha / value.shape[1])
        if fmt == "comfyui":
            name = f"diffusion_model.{orig}"
            out[f"{name}.lora_{ab}.weight"] = value
        else:
            name = "lora_unet_" + orig.replace(".", "_")
            out[f"{name}.lora_{'down' if ab == 'A' else 'up'}.weight"] = value
        if keys.alpha:
            out[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def is_converted(sd: dict[str, torch.Tensor]) -> bool:
    """A ComfyUI / kohya layout (as opposed to diffusers' `transformer.` keys)."""
    return any(k.startswith(("diffusion_model.", "lora_unet_")) for k in sd)


def to_diffusers(sd: dict[str, torch.Tensor], keys: KeyMap, modules: set[str],
                 prefix: str = "transformer") -> tuple[dict[str, torch.Tensor], float | None]:
    """A comfyui / kohya LoRA (as `convert` writes them; musubi-tuner's files) of a model whose
    adapted modules are `modules` (diffusers names) -> (`<prefix>.<module>.lora_A.weight` /
    `.lora_B.weight`, alpha). The file's alphas must be one value (None when it has none: scale 1,
    ComfyUI's reading). A key naming no module of `modules` under `keys` is refused in one line."""
    names = {}
    for module in modules:
        try:
            orig = keys.original(module)
        except ValueError:
            continue  # not in the map: a file cannot name it, and the load says which is missing
        names[f"diffusion_model.{orig}"] = names["lora_unet_" + orig.replace(".", "_")] = module
    out: dict[str, torch.Tensor] = {}
    alphas = set()
    for key, value in sd.items():
        name, _, rest = key.partition(".") if key.startswith("lora_unet_") else key.rpartition(".lora_")
        if key.endswith(".alpha"):
            name, rest = key.removesuffix(".alpha"), "alpha"
        part = {"A.weight": "lora_A", "B.weight": "lora_B", "lora_down.weight": "lora_A",
                "lora_up.weight": "lora_B", "alpha": "alpha"}.get(rest)
        if part is None or name not in names:
            raise ValueError(f"{key}: not a LoRA down / up weight or alpha of a {keys.family} module this run adapts "
                             f"(adapted: {len(modules)} modules, e.g. {sorted(modules)[:2]})")
        if part == "alpha":
            alphas.add(float(value))
            continue
        out[f"{prefix}.{names[name]}.{part}.weight"] = value
    if len(alphas) > 1:
        raise ValueError(f"the LoRA file has {len(alphas)} different alphas ({sorted(alphas)[:4]}); one is supported")
    return out, (alphas.pop() if alphas else None)
