"""A quantized frozen base for LoRA runs (model.base_quant): the frozen nn.Linear weights of the
transformer blocks stored in int8, fp8, fp8_scaled or nf4 by torchao, the adapters, norms, embeddings and
everything outside the blocks kept in the training dtype.

The backend is torchao: its weight-only configs through `torchao.quantization.quantize_` (the
path diffusers' TorchAoConfig and peft's TorchaoLoraLinear build on), and its QLoRA tensor
`to_nf4` (no quantize_ config exists for it; torchtune's QLoRA uses it the same way):

    int8 -> Int8WeightOnlyConfig     per-output-row absmax scale, int8 values   (1 B / weight)
    fp8  -> Float8WeightOnlyConfig   per-row scale, float8_e4m3fn values        (1 B / weight)
    fp8_scaled -> Float8WeightOnlyConfig(granularity=PerGroup(64)): a scale per 64 inputs of
                                     each row (musubi-tuner's --fp8_scaled)     (~1.06 B / weight)
    nf4  -> to_nf4                   4-bit NormalFloat codes, one absmax per 64 values (in
                                     flattened order), the absmaxes themselves 8-bit in groups of
                                     up to 256 (QLoRA's double quantization)    (~0.52 B / weight)

Each frozen `nn.Linear` of a block (peft's `X.base_layer` of an adapted layer, and the
untargeted linears such as the FFN of an attention-only LoRA) has its `weight` replaced by a
torchao tensor subclass [out, in] that dequantizes inside F.linear; its bias stays as it was.
The input gradient flows through it (the adapters before it in the block need it); the weight
itself never gets one. Quantization is a pure function of the full weight, so every rank that
holds the same full weights holds the same quantized ones: the layouts stay exact.

Order: LoRA injected, weights loaded or initialised, then `quantize_base`, then parallelize
(the quantized weights are not sharded by FSDP2: `quantized_parameters` lists them for its
ignored_params; each rank keeps the whole quantized base, 1 B per weight).
nf4 needs each quantized weight's size to be a multiple of NF4_BLOCK, fp8_scaled each input
width a multiple of FP8_GROUP (`unfit` names the first layer that is not: refused before any
worker starts). nf4's double-quantization group is the largest power of two <= 256 dividing the
layer's number of blocks (256 on real models' layers; smaller on the tiny test models, whose
layers hold fewer than 64 x 256 values).
Not here: bitsandbytes' 4-bit (CUDA only), fp8 with a scaled activation path (needs sm89+ GPUs).
"""
from __future__ import annotations

import logging
import math
from typing import Iterable

import torch
from torch import nn

# model.base_quant -> torchao's weight-only config class (torchao.quantization) and its granularity
CONFIGS = {"int8": ("Int8WeightOnlyConfig", None), "fp8": ("Float8WeightOnlyConfig", None),
           "fp8_scaled": ("Float8WeightOnlyConfig", "PerGroup")}
KINDS = (*CONFIGS, "nf4")  # every model.base_quant but none
FP8_GROUP = 64  # fp8_scaled: input values per scale in each output row (musubi-tuner's --fp8_scaled block)
NF4_BLOCK = 64  # values per absmax scale (QLoRA's and torchao's default)
NF4_SCALER_BLOCK = 256  # absmaxes per 8-bit double-quantization group, at most (QLoRA's default)


class _Drop(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# Two import-time warnings that torchao's presence causes in every LoRA or diffusers run, neither
# about anything we use (peft imports torchao whenever it is installed; diffusers' torchao quantizer
# module is imported with its models): torchao's CPU-torch build cannot load its CUDA-only
# extensions (mxfp8, cutlass), as expected; diffusers 0.42 looks for torchao < 0.16 classes
# (UintxTensor) to allow-list for loading torchao-serialized checkpoints, which we never load.
logging.getLogger("torchao").addFilter(_Drop("Failed to load"))
logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(_Drop("Unable to import `torchao`"))


def torchao():
    """torchao with its quantization API (an ImportError where it is not installed)."""
    import torchao as ao  # deferred: optional (the quant extra); model.base_quant only
    import torchao.quantization  # noqa: F401  (the configs and quantize_)
    return ao


def available() -> bool:
    """Whether torchao imports here."""
    try:
        torchao()
    except ImportError:
        return False
    return True


def config(kind: str):
    """torchao's weight-only config for model.base_quant=`kind` (int8 | fp8 | fp8_scaled); its
    default granularity (per row) unless CONFIGS names one."""
    if kind not in CONFIGS:
        raise ValueError(f"model.base_quant={kind!r} has no torchao config (one of {', '.join(CONFIGS)})")
    q = torchao().quantization
    name, granularity = CONFIGS[kind]
    return getattr(q, name)(granularity=q.PerGroup(FP8_GROUP)) if granularity else getattr(q, name)()


def nf4_scaler_block(numel: int) -> int:
    """The double-quantization group of an nf4 weight of `numel` values (a multiple of NF4_BLOCK):
    torchao needs it to divide the number of blocks; the largest power of two <= 256 that does."""
    return math.gcd(numel // NF4_BLOCK, NF4_SCALER_BLOCK)


def unfit(kind: str, named: Iterable[tuple[str, nn.Linear]]) -> str:
    """'' if every (name, linear) weight can be stored as `kind`, else one line naming the first
    that cannot and what to change: nf4 needs the weight's size a multiple of NF4_BLOCK,
    fp8_scaled its input width a multiple of FP8_GROUP (musubi-tuner falls back to one scale
    per tensor there; we refuse rather than mix granularities under one name)."""
    for name, layer in named:
        out_f, in_f = layer.weight.shape
        if kind == "fp8_scaled" and in_f % FP8_GROUP:
            return (f"model.base_quant=fp8_scaled scales each row's weights in groups of {FP8_GROUP} inputs: {name} "
                    f"({out_f}x{in_f}) has {in_f} inputs, not a multiple of {FP8_GROUP}; change the model's widths "
                    f"or use model.base_quant=fp8 (one scale per row)")
        if kind == "nf4" and (out_f * in_f) % NF4_BLOCK:
            return (f"model.base_quant=nf4 stores each frozen weight in blocks of {NF4_BLOCK} values: {name} "
                    f"({out_f}x{in_f} = {out_f * in_f} values) is not a multiple of {NF4_BLOCK}; change the model's "
                    f"widths (e.g. model.dim a multiple of 8) or use model.base_quant=int8 or fp8")
    return ""


def _to_nf4(layer: nn.Linear) -> None:
    """Replace `layer.weight` [out, in] by torchao's NF4Tensor of it (frozen). F.linear on it goes
    through torchao's linear_nf4: the weight dequantized to the input's dtype, the input gradient
    computed against that dequantized weight, no weight gradient."""
    from torchao.quantization import to_nf4  # deferred: optional (the quant extra)

    w = layer.weight.detach().contiguous()
    layer.weight = nn.Parameter(to_nf4(w, NF4_BLOCK, nf4_scaler_block(w.numel())), requires_grad=False)


def frozen_linears(blocks: Iterable[nn.Module]) -> list[nn.Linear]:
    """The nn.Linear layers inside `blocks` none of whose parameters train: the base layers of
    LoRA-adapted linears and the linears no adapter targets (lora_A / lora_B train: excluded)."""
    out = []
    for block in blocks:
        for m in block.modules():
            if isinstance(m, nn.Linear) and not any(p.requires_grad for p in m.parameters()):
                out.append(m)
    return out


@torch.no_grad()
def quantize_base(blocks: Iterable[nn.Module], kind: str) -> int:
    """Quantize the weights of `frozen_linears(blocks)` in place with torchao (see the module
    docstring); returns how many layers were quantized. kind "none": nothing."""
    if kind == "none":
        return 0
    layers = frozen_linears(blocks)
    if kind == "nf4":
        for layer in layers:
            _to_nf4(layer)
        return len(layers)
    cfg = config(kind)
    quantize = torchao().quantization.quantize_
    for layer in layers:
        # quantize_ replaces the weight of the module it is given (and of its nn.Linear children)
        quantize(layer, cfg)
    return len(layers)


def is_quantized(t: torch.Tensor) -> bool:
    """Whether `t` is a torchao quantized tensor (without importing torchao when it is not)."""
    return any(c.__module__.startswith("torchao.") for c in type(t).__mro__)


def quantized_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that quantize_base replaced (FSDP2's ignored_params, DDP's
    ignored names: they are frozen and identical on every rank, never sharded nor reduced)."""
    return [p for p in model.parameters() if is_quantized(p)]


def quantized_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if is_quantized(p)]


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`'s values (a quantized one dequantized; others unchanged). torchao's
    NF4Tensor names it get_original_weight (its `dequantize` is a static helper of its codes)."""
    if not is_quantized(t):
        return t
    return t.get_original_weight() if hasattr(t, "get_original_weight") else t.dequantize()


def probe(kind: str, device: str, dtype: torch.dtype = torch.float32) -> str:
    """'' if torchao quantizes a small Linear to `kind` on `device` and runs its forward and input
    backward there, else the reason (one line): checked before any worker starts."""
    if kind == "none":
        return ""
    try:
        torchao()
    except ImportError as exc:
        return (f"model.base_quant={kind} needs torchao ({exc}); install it: pip install 'dit_train[quant]' "
                f"(or pip install torchao), or set model.base_quant=none")
    try:
        layer = nn.Linear(64, 32, device=device, dtype=dtype).requires_grad_(False)
        quantize_base([layer], kind)
        x = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
        layer(x).sum().backward()
        if x.grad is None or not bool(torch.isfinite(x.grad).all()):
            raise RuntimeError("no finite input gradient")
    except Exception as exc:  # any backend failure means: this quantization cannot run here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"model.base_quant={kind}: torchao cannot run a {kind} linear on {device} here ({first[:160]}); "
                f"pick another model.base_quant ({', '.join(['none', *KINDS])})")
    return ""
