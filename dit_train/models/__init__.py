"""Plain single-device models. Parallelism is applied from outside (dit_train.parallel)."""
from __future__ import annotations

import math

from torch import nn

from dit_train.config import ModelConfig
from dit_train.models.dit import VideoDiT
from dit_train.models.init import init_weights, initialize
from dit_train.models.layers import Block, Conditioning
from dit_train.models.lm import CausalLM


def patch_dim(cfg: ModelConfig) -> int:
    return cfg.in_channels * math.prod(cfg.patch_size)


def build_model(cfg: ModelConfig, attn_backend: str = "sdpa") -> nn.Module:
    """Construct (uninitialised) the model named by cfg.name; call init_weights afterwards."""
    common = dict(dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, mlp_ratio=cfg.mlp_ratio,
                  qk_norm=cfg.qk_norm, rope_theta=cfg.rope_theta, backend=attn_backend)
    if cfg.name == "dit":
        if len(cfg.patch_size) != 3:
            raise ValueError(f"model.patch_size={list(cfg.patch_size)} must be [t, h, w]")
        return VideoDiT(patch_dim=patch_dim(cfg), text_dim=cfg.text_dim, **common)
    if cfg.name == "wan":
        from dit_train.models.wan import PackedWan  # imports diffusers: only when asked for

        return PackedWan(cfg, attn_backend)
    if cfg.name == "lm":
        return CausalLM(vocab_size=cfg.vocab_size, **common)
    raise ValueError(f"model.name={cfg.name!r} must be 'dit', 'wan' or 'lm'")


__all__ = ["Block", "CausalLM", "Conditioning", "VideoDiT", "build_model", "init_weights", "initialize", "patch_dim"]
