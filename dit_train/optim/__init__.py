"""Optimizer and learning-rate schedule from OptimConfig."""
from __future__ import annotations

import math

import torch
from torch import nn

from dit_train.config import OptimConfig
from dit_train.models.registry import blocks_of
from dit_train.optim.low_bit import adamw8bit
from dit_train.optim.muon import MUON_EPS, MuonAdamW, muon_split


def build_optimizer(model: nn.Module, cfg: OptimConfig, params: list[nn.Parameter] | None = None,
                    blocks: nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer of `params` (None: every parameter of `model` that requires grad). blocks:
    the model's repeated transformer blocks, whose 2-D weights Muon takes (the model spec's
    `blocks`: diffusers families keep them as `transformer_blocks`); None = `model.blocks`."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    if cfg.name == "adamw":
        # foreach=False: the per-tensor path is bitwise independent of how tensors are grouped,
        # so sharded and unsharded runs apply identical updates.
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, foreach=False)
    if cfg.name == "adamw8bit":  # 8-bit moments (torchao): dit_train/optim/low_bit.py
        return adamw8bit(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "muon":
        # DDP wraps the model: its blocks are the wrapped module's
        muon, adamw = muon_split(blocks_of(getattr(model, "module", model)) if blocks is None else blocks, params)
        return MuonAdamW(muon, adamw, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                         betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=False)
    raise ValueError(f"optim.name={cfg.name!r} must be adamw, adamw8bit, muon or sgd")


def configured_group(group: dict, cfg: OptimConfig) -> dict:
    """The hyperparameters of one param group that `cfg` sets (a resumed run applies them over
    the checkpoint's): Muon's matrices take optim.muon_momentum and Muon's own eps, AdamW's and
    SGD's groups optim.eps / optim.momentum / optim.betas where the group has them."""
    own = {"momentum": cfg.muon_momentum, "eps": MUON_EPS} if group.get("kind") == "muon" else \
        {"eps": cfg.eps, "momentum": cfg.momentum, "betas": tuple(cfg.betas)}
    values = {k: v for k, v in own.items() if k in group}
    if "weight_decay" in group:
        values["weight_decay"] = cfg.weight_decay
    return {**values, "initial_lr": cfg.lr}


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warmup, then schedule."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return 1.0 - (1 - cfg.min_lr_ratio) * progress
    raise ValueError(f"optim.schedule={cfg.schedule!r} must be constant, cosine or linear")


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    # the base LR a Python float, as a resume sets it (engine/resume.py): LambdaLR would otherwise take
    # a torchao optimizer's fp32 LR tensor as its base, and lr = base * factor rounded differently
    # would make a resumed run differ from the uninterrupted one in the last bit
    for group in opt.param_groups:
        group.setdefault("initial_lr", float(cfg.lr))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, cfg))
