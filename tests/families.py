"""Helpers the model-family tests share (tests/test_wan*.py, test_ltx*.py, test_hunyuan15.py,
test_skyreels_v2.py, test_lora.py, test_diffusers_families.py): the two clips the
packed-vs-diffusers comparisons run and their gradient check, a model whose every weight is
random, a family's tiny run and a pretrained folder for it."""
from __future__ import annotations

import torch

from dit_train.models import build_model, init_weights
from dit_train.models.diffusers_family import to_diffusers
from tests.conftest import compose_config, TINY

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


def family_run_cfg(overrides: list[str], data_cache: str):
    """A family's tiny training run on the embedded clips (TINY, then `overrides`), data prepared;
    gradients always clipped (0.05), so layout cases check the global norm too."""
    from dit_train.data_pipelines import prepare_data

    cfg = compose_config([*overrides[:1], *TINY, *overrides[1:], "optim.max_grad_norm=0.05"], cache_dir=data_cache)
    prepare_data(cfg.data, cfg.model)
    return cfg


def pretrained_folder(cfg, folder):
    """`folder`/transformer: a diffusers folder with random weights of the model `cfg`'s shape
    (nothing downloaded), inside a pipeline-like folder `folder`."""
    path = folder / "transformer"
    to_diffusers(random_model(cfg, seed=7).state_dict(), cfg).save_pretrained(str(path))
    return path


def lora_run_cfg(cfg, folder, rank: int = 4, alpha: int = 8):
    """`cfg` as LoRA (rank, alpha; the family's default targets) on a random pretrained folder of
    its shape written under `folder` (pretrained_folder)."""
    from dataclasses import replace

    path = pretrained_folder(cfg.model, folder)
    return replace(cfg, model=replace(cfg.model, pretrained=str(path), lora=replace(cfg.model.lora, rank=rank, alpha=alpha)))


def assert_grads_match(ours: torch.nn.Module, ref: torch.nn.Module, rel: float = 1e-4) -> None:
    """After backward through both: every parameter of `ours` has a gradient, and it is within
    rel x (the largest |gradient|) of the gradient of `ref`'s parameter of the same name."""
    ref_grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        gr = ref_grads[name].grad
        assert p.grad is not None and gr is not None, name
        assert (p.grad - gr).abs().max() <= rel * gr.abs().max().clamp_min(1e-6), name


def assert_matches_diffusers_per_clip(ours: torch.nn.Module, ref: torch.nn.Module, out: torch.Tensor,
                                      clips: list[torch.Tensor], theirs_of, out_channels: int,
                                      generator: torch.Generator) -> None:
    """Our packed output out [L, C·pt·ph·pw] (the clips' tokens in order, then padding) clip by
    clip against diffusers' `theirs_of(i, clip, grid)` ([C, F, H, W] of clip i alone): values within
    1e-5, padding tokens finite, and the weight gradients of random probe-weighted sums of both
    outputs equal (assert_grads_match)."""
    from dit_train.tasks.video import unpatchify

    loss_ours, loss_ref, off = 0.0, 0.0, 0
    for i, clip in enumerate(clips):
        grid = tuple(s // p for s, p in zip(clip.shape[1:], PATCH))
        n = grid[0] * grid[1] * grid[2]
        mine = unpatchify(out[off:off + n], grid, PATCH, out_channels)
        off += n
        theirs = theirs_of(i, clip, grid)
        assert theirs.shape == mine.shape
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        probe = torch.randn(mine.shape, generator=generator)
        loss_ours, loss_ref = loss_ours + (mine * probe).sum(), loss_ref + (theirs * probe).sum()
    assert out[off:].abs().max() < 1e3  # padding tokens: finite, ignored
    loss_ours.backward()
    loss_ref.backward()
    assert_grads_match(ours, ref)
