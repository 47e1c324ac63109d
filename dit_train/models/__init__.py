"""Plain single-device models, one module each, found through the registry (`MODELS`).
Parallelism is applied from outside (dit_train.parallel)."""
from __future__ import annotations

from typing import Any

from torch import nn

from dit_train.models import dit, hunyuan15, lm, ltx, ltx2, minimax_h3, skyreels_v2, wan, wan_vace  # noqa: F401  (each registers its ModelSpec)
from dit_train.models.dit import DiTConfig, VideoDiT, patch_dim
from dit_train.models.init import init_weights, initialize
from dit_train.models.layers import Block, Conditioning
from dit_train.models.lm import CausalLM, LMConfig
from dit_train.models.recompute import set_recompute_prologues
from dit_train.models.registry import MODELS, ModelSpec, model_spec
from dit_train.models.wan import WanConfig


def build_model(cfg: Any, attn_backend: str = "sdpa") -> nn.Module:
    """Construct (uninitialised) the model `cfg.name` names; call `initialize` afterwards."""
    return set_recompute_prologues(model_spec(cfg).build(cfg, attn_backend), cfg.recompute_prologues)


def model_config(name: str, **keys: Any) -> Any:
    """A model's config node with the given keys (for code and tests that build models directly)."""
    return MODELS[name].config(**keys)


__all__ = ["MODELS", "Block", "CausalLM", "Conditioning", "DiTConfig", "LMConfig", "ModelSpec", "VideoDiT", "WanConfig",
           "build_model", "init_weights", "initialize", "model_config", "model_spec", "patch_dim"]
