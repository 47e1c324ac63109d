"""What the rest of dit_train needs to know about a model, declared once per model.

A model is one module (`dit_train/models/<name>.py`: its config node, its nn.Module and a
`ModelSpec` registered in `MODELS`) plus one or more YAML files (`conf/model/*.yaml`, whose
defaults list names `<name>_schema`). Everything else — building and initialising it,
parallelizing it (FSDP units, the attention layers context parallelism swaps), exporting it,
and the planner's memory/FLOP model — goes through the spec, so no file outside the model's
own module branches on its name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from dit_train.config.choices import Mode
from dit_train.registry import Registry


@dataclass(frozen=True)
class ActivationModel:
    """Bytes a block saves for backward per token, as multiples of the model width d and of
    the MLP hidden width h (see dit_train/perf/memory.py, which adds statistics and CP terms):

        fp32 run:           (fp32_d·d + h_elems·h)·4
        bf16/fp16 autocast:  autocast_f32_d·d·4 + (autocast_lp_d·d + h_elems·h)·c
        selective AC:        (selective_d·d + h_elems_selective·h)·c   (per checkpointed block)

    Outside the blocks, per token: outside_d·d·c + 2·io_dim·4 (+ head_dim·4 of RoPE tables).
    Each model's numbers are read off its autograd graph; tests/test_planner.py checks every
    registered model against `saved_tensors_hooks` measurements.
    """

    fp32_d: float
    autocast_f32_d: float
    autocast_lp_d: float
    h_elems: float = 2.0
    outside_d: float = 6.0
    # kept under model.activation_checkpointing=selective (matmul / attention outputs and the
    # block input; all in the compute dtype): (selective_d·d + h_elems_selective·h)·c
    selective_d: float = 7.0
    h_elems_selective: float = 1.0
    # a mixture-of-experts block saves, per token, k·(3·d + 2·h)·c + 8·E + 16·k bytes (rows sent
    # to experts, their fc1 and GELU outputs, gated outputs; fp32 router logits and probabilities;
    # int64 routing indices) less (moe_dense_d·d + moe_dense_h·h)·c of the dense MLP's (perf/memory.py)
    moe_dense_d: float = 0.0
    moe_dense_h: float = 0.0


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks: FSDP units, activation-checkpointing and compile units
    (wrappers are set back into this list)."""
    return model.blocks


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """Modules holding an `attention_fn` callable: where context parallelism swaps in its own."""
    return [m for m in model.modules() if hasattr(m, "attention_fn")]


def no_checks(cfg: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: type  # the model's config node (a ModelConfig subclass)
    mode: Mode  # the task it serves: video (velocity of patch tokens) or llm (next-token logits)
    build: Callable[[Any, str], nn.Module]  # (model config, attention backend) -> plain, uninitialised model
    activations: Callable[[Any], ActivationModel]  # of a config (e.g. caption cross-attention adds terms)
    # per-token matmul weights, for FLOPs (6·N per token): of a block (given the block; a
    # mixture of experts counts its router and top_k experts, models/moe.py), outside the blocks
    block_linears: Callable[[nn.Module], list[nn.Module]]
    io_linears: Callable[[nn.Module], list[nn.Module]]
    io_dim: Callable[[Any], int]  # patch values per token (video) or vocabulary size (llm)
    hidden: Callable[[Any], int]  # MLP hidden width
    blocks: Callable[[nn.Module], nn.ModuleList] = blocks_of
    attention_layers: Callable[[nn.Module], list[nn.Module]] = attention_layers
    # model-specific configuration errors, each one line naming the key to change
    checks: Callable[[Any], list[str]] = no_checks
    # full fp32 state dict (plain names) from the config's `pretrained` folder; None = not supported
    pretrained: Callable[[Any], dict] | None = None
    # a diffusers model holding a full state dict (for `export_weights --diffusers`); None = not supported
    to_diffusers: Callable[[dict, Any], Any] | None = None
    # {state-dict prefix: subfolder of an export DIR} of the diffusers models the model holds
    # ("" = the whole state dict / DIR itself; Wan 2.2 A14B's low-noise expert {"": "transformer_2"},
    # as its pipeline folder holds it; both experts in one run {"transformer": "transformer",
    # "transformer_2": "transformer_2"}): full-weight exports and LoRA files, one per component
    components: Callable[[Any], dict[str, str]] = lambda cfg: {"": ""}
    # joint text-video attention: each clip's caption tokens are slots of the pack, weight 0
    # (tasks/joint_text.py; the model reads them through its `text` argument)
    joint_text: bool = False
    # an audio token's RoPE position (tasks/joint_audio.py): "frames" = (its first sample's time in
    # temporal patches, fractional, 0, 0), one sequence with the video (the two-stream DiT); "index" = (its index
    # in its clip's track, 0, 0), its own stream's coordinates (LTX-2)
    audio_positions: str = "frames"
    # a model with an audio stream that also trains without sound (data.audio=false: every clip is
    # video alone, LTX-2 fine-tuned on silent films); False = data.audio=true is required
    silent_ok: bool = False
    moe: bool = False  # builds mixture-of-experts blocks from `model.moe` (models/moe.py)
    # latent compression (t, h, w) of the family's VAE: the clip planner's default (tools.plan --frames)
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    # Linear layers LoRA adapts when model.lora.targets is empty (peft `target_modules`: name
    # suffixes, or one regex matched against whole names); () = none, the targets must be given
    lora_targets: tuple[str, ...] | str = ()
    # a diffusers transformer family: its models/diffusers_family.DiffusersFamily (folders, checks,
    # export); None = ours alone. Typed Any: that module builds specs, so it imports this one
    diffusers: Any = None
    notes: dict = field(default_factory=dict)


MODELS: Registry[ModelSpec] = Registry("model")


def register_model(spec: ModelSpec) -> ModelSpec:
    return MODELS.register(spec.name, spec)


def model_spec(cfg: Any) -> ModelSpec:
    """The spec of a model config (by its `name`)."""
    return MODELS[cfg.name]


def can_widen(cfg: Any) -> bool:
    """The family can widen a text-to-video folder's input for cond.feed=concat / cond.control
    (new channels start at zero), so LoRA on such a run trains that input layer too."""
    family = model_spec(cfg).diffusers
    return family is not None and bool(family.widen_key)


def widens_pretrained(cfg: Any) -> bool:
    """model.pretrained's input gets this run's new channels; LoRA then trains the input layer
    beside the adapters (models/lora.py: LoraSettings.train_also)."""
    family = model_spec(cfg).diffusers
    return family is not None and family.widens(cfg)


def component_state(state_dict: dict, prefix: str) -> dict:
    """The entries of `state_dict` under `prefix.` with it removed ("" = all of them)."""
    if not prefix:
        return state_dict
    return {k[len(prefix) + 1:]: v for k, v in state_dict.items() if k.startswith(prefix + ".")}
