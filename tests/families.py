"""Helpers the model-family tests share (tests/test_wan*.py, test_ltx.py, test_hunyuan15.py,
test_lora.py): the two clips the packed-vs-diffusers comparisons run, and a model whose every
weight is random."""
from __future__ import annotations

import torch

from dit_train.models import build_model, init_weights

PATCH = (1, 2, 2)
SHAPES = [(2, 4, 6), (3, 2, 4)]  # (F, H, W) of the two clips: 12 and 6 tokens


def random_model(cfg, seed: int = 0) -> torch.nn.Module:
    """`cfg`'s model with every weight random (norm gains, modulation tables and the like too,
    which a family's own init leaves at 0 or 1), so no swapped or misread weight goes unseen."""
    model = build_model(cfg)
    init_weights(model, seed, "normal")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model
