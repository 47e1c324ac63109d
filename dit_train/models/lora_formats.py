"""LoRA files for the tools people load Wan LoRAs in: ComfyUI and kohya / musubi-tuner.

Our LoRA files are diffusers' (models/lora.py): `transformer.<diffusers module>.lora_A.weight`
[r, in] / `.lora_B.weight` [out, r], alpha in the header's adapter metadata. ComfyUI and
musubi-tuner name the modules as Wan's original checkpoint does (blocks.N.self_attn.q, ...,
ffn.0), which is the naming diffusers' own Wan LoRA readers convert from
(diffusers.loaders.lora_conversion_utils: `_convert_non_diffusers_wan_lora_to_diffusers`,
`_convert_musubi_wan_lora_to_diffusers`); the module map below is theirs, read in the other
direction. Two layouts:

    comfyui   diffusion_model.<orig>.lora_A.weight, .lora_B.weight, diffusion_model.<orig>.alpha
              (musubi-tuner's convert_lora.py "other" format, "Diffusers/ComfyUI": ComfyUI's Wan
              models take the diffusion_model.<key> names of their own state dict)
    kohya     lora_unet_<orig, "." -> "_">.lora_down.weight, .lora_up.weight, .alpha
              (musubi-tuner's / sd-scripts' native format; ComfyUI maps lora_unet_<key with _>
              to every weight of its model too)

alpha is a 0-d float32 tensor per module, the value ComfyUI (`lora[alpha_name].item()`) and the
diffusers converters read; the weight delta is alpha / r · up @ down, as in our training. Only
the Wan family (T2V, I2V, VACE's shared blocks) is mapped: the other families' original key maps
were not read, so their export is refused.
"""
from __future__ import annotations

import re

import torch

FORMATS = ("diffusers", "comfyui", "kohya")

# diffusers module suffix inside a Wan block -> Wan's original name (diffusers' converters, reversed)
_WAN_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v", "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
# outside the blocks
_WAN_TOP = {"condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head"}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def wan_original_name(module: str) -> str:
    """A Wan module's diffusers name -> its name in Wan's original checkpoint (ComfyUI's)."""
    m = _BLOCK.match(module)
    if m and m.group(2) in _WAN_BLOCK:
        return f"blocks.{m.group(1)}.{_WAN_BLOCK[m.group(2)]}"
    if module in _WAN_TOP:
        return _WAN_TOP[module]
    raise ValueError(f"no ComfyUI / kohya name known for the Wan module {module!r} (mapped: the blocks' "
                     f"attention and FFN linears, time_proj, proj_out); export it with --lora-format diffusers")


def diffusers_name(original: str) -> str:
    """The inverse of wan_original_name."""
    m = re.match(r"^blocks\.(\d+)\.(.+)$", original)
    inverse = {v: k for k, v in _WAN_BLOCK.items()}
    if m and m.group(2) in inverse:
        return f"blocks.{m.group(1)}.{inverse[m.group(2)]}"
    top = {v: k for k, v in _WAN_TOP.items()}
    if original in top:
        return top[original]
    raise ValueError(f"no diffusers name known for the Wan module {original!r}")


def convert(sd: dict[str, torch.Tensor], alpha: float, fmt: str, prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """Our diffusers LoRA tensors (`<prefix>.<module>.lora_A.weight` / `.lora_B.weight`, one alpha
    for every module, unfolded: delta = alpha / r · B @ A) -> the same adapters in `fmt`
    (comfyui | kohya; see the module docstring). Tensors are passed through unchanged."""
    if fmt == "diffusers":
        return dict(sd)
    if fmt not in FORMATS:
        raise ValueError(f"--lora-format {fmt!r} must be one of {', '.join(FORMATS)}")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        body = key.removeprefix(prefix + ".")
        module, _, kind = body.rpartition(".lora_")  # kind: "A.weight" | "B.weight"
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"{key} is not a LoRA tensor (X.lora_A.weight / X.lora_B.weight)")
        orig = wan_original_name(module)
        if fmt == "comfyui":
            name = f"diffusion_model.{orig}"
            out[f"{name}.lora_{kind}"] = value
        else:
            name = "lora_unet_" + orig.replace(".", "_")
            out[f"{name}.lora_{'down' if kind == 'A.weight' else 'up'}.weight"] = value
        out[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def to_diffusers(sd: dict[str, torch.Tensor], prefix: str = "transformer") -> tuple[dict[str, torch.Tensor], float | None]:
    """A comfyui / kohya Wan LoRA (as `convert` writes them; musubi-tuner's files) -> (diffusers
    keys `<prefix>.<module>.lora_A.weight` / `.lora_B.weight`, alpha). The file's alphas must be one
    value (None when it has none: alpha = r); a diffusers file is returned as it is."""
    if not any(k.startswith(("diffusion_model.", "lora_unet_")) for k in sd):
        return dict(sd), None
    out: dict[str, torch.Tensor] = {}
    alphas = set()
    for key, value in sd.items():
        if key.startswith("diffusion_model."):
            name, _, kind = key.removeprefix("diffusion_model.").rpartition(".")
            if kind == "alpha":
                alphas.add(float(value))
                continue
            module, _, ab = name.rpartition(".lora_")  # ab: "A" | "B", kind "weight"
            part = {"A": "lora_A", "B": "lora_B", "down": "lora_A", "up": "lora_B"}.get(ab)
            original = module
        elif key.startswith("lora_unet_"):
            name, _, rest = key.removeprefix("lora_unet_").partition(".")
            if rest == "alpha":
                alphas.add(float(value))
                continue
            part = {"lora_down.weight": "lora_A", "lora_up.weight": "lora_B"}.get(rest)
            original = _unflatten(name)
        else:
            part, original = None, ""
        if part is None:
            raise ValueError(f"{key}: not a LoRA down/up weight or alpha of a ComfyUI / kohya Wan LoRA")
        out[f"{prefix}.{diffusers_name(original)}.{part}.weight"] = value
    if len(alphas) > 1:
        raise ValueError(f"the LoRA file has {len(alphas)} different alphas ({sorted(alphas)[:4]}); one is supported")
    return out, (alphas.pop() if alphas else None)


def _unflatten(name: str) -> str:
    """kohya's `blocks_3_self_attn_q` -> `blocks.3.self_attn.q` (Wan's names, whose own
    underscores are those of self_attn, cross_attn, k_img, v_img)."""
    for orig in (*(f"blocks.{{}}.{v}" for v in _WAN_BLOCK.values()), *_WAN_TOP.values()):
        pattern = re.escape(orig.replace(".", "_")).replace(r"\{\}", r"(\d+)")
        m = re.fullmatch(pattern, name)
        if m:
            return orig.format(*m.groups())
    raise ValueError(f"lora_unet_{name}: not a module of a Wan LoRA")
