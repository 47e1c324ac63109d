"""Wan VACE (model.name=wan_vace): diffusers' WanVACETransformer3DModel through the packed path
(models/wan_vace.py), trained with cond.control=true (docs/conditioning.md#wan-vace).

1. The packed model equals diffusers' own forward run clip by clip, forward and weight gradients,
   with the hints added after unsorted vace_layers; the context is the input tokens' last features.
2. Runs: a pixel folder with clip.control.mp4 (wan_vace_tiny) and a latent cache written with
   --control (its inactive latents: the zero video encoded), LoRA on the VACE blocks too; the export
   loads in diffusers' WanVACETransformer3DModel with our outputs; tools.sample --control.
3. Bad input is refused before the run. (Layout exactness: tests/test_conditioning.py, VACE_CASE.)
"""
from __future__ import annotations

import pytest
import torch

from dit_train.models import model_config
from dit_train.models.wan import to_diffusers
from dit_train.tasks.conditioning import vace_context
from dit_train.tasks.video import patchify, unpatchify
from tests.families import PATCH, SHAPES, random_model
from tests.test_wan import pack

C, K = 4, 4  # latent channels, VACE mask channels: a 12-channel context [inactive 4 | reactive 4 | mask 4]


def tiny_vace_cfg(**kw):
    base = dict(dim=32, heads=2, depth=3, ffn_dim=64, freq_dim=32, text_dim=32, text_len=6, in_channels=C,
                patch_size=list(PATCH), init="normal", vace_layers=[2, 0], vace_mask_channels=K, cond_channels=2 * C + K)
    return model_config("wan_vace", **(base | kw))


def test_packed_vace_matches_diffusers_per_clip():
    cfg = tiny_vace_cfg()
    ours = random_model(cfg)
    ref = to_diffusers(ours.state_dict(), cfg)  # diffusers' WanVACETransformer3DModel, same weights
    assert type(ref).__name__ == "WanVACETransformer3DModel"
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(C, *s, generator=g) for s in SHAPES]
    ctrls = [vace_context(torch.randn(C, *s, generator=g), torch.randn(C, *s, generator=g), K) for s in SHAPES]
    t = torch.tensor([0.3, 0.85])
    context, context_len = torch.randn(2, 5, 32, generator=g), torch.tensor([3, 5])
    x, pos, seg, meta = pack([torch.cat([c, v]) for c, v in zip(clips, ctrls)], pad=3)
    out = ours(x, pos, seg, t, meta, context, context_len)
    probes = [torch.randn(C, *s, generator=g) for s in SHAPES]
    loss_ours, loss_ref, off = 0.0, 0.0, 0
    for i, clip in enumerate(clips):
        grid = tuple(clip.shape[1 + a] // PATCH[a] for a in range(3))
        n = grid[0] * grid[1] * grid[2]
        mine = unpatchify(out[off:off + n], grid, PATCH, C)
        off += n
        ctx = torch.nn.functional.pad(context[i:i + 1, :context_len[i]], (0, 0, 0, cfg.text_len - int(context_len[i])))
        theirs = ref(clip[None], t[i:i + 1] * 1000, ctx, control_hidden_states=ctrls[i][None]).sample[0]
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        loss_ours = loss_ours + (mine * probes[i]).sum()
        loss_ref = loss_ref + (theirs * probes[i]).sum()
    loss_ours.backward()
    loss_ref.backward()
    ref_grads = dict(ref.named_parameters())
    assert any(n.startswith("vace_blocks.") for n in ref_grads)
    for name, p in ours.named_parameters():
        gr = ref_grads[name].grad
        assert p.grad is not None and gr is not None, name
        assert (p.grad - gr).abs().max() <= 1e-4 * gr.abs().max().clamp_min(1e-6), name


# --------------------------------------------------------------------------- runs


def vace_cache_cfg(companion_cache, extra: list[str] = ()):
    """wan_vace_tiny on the companion latent cache (tests/conftest.py, --masks --control): the
    tiny VAE's 8x8 pixels per latent pixel give 64 mask channels, as Wan's."""
    from tests.conftest import TEXT_DIM, TINY_MODEL, Z_DIM, compose_config

    cfg = compose_config([*TINY_MODEL, "model=wan_vace_tiny", "model.heads=2", "model.patch_size=[1,2,2]",
                          "data=latent_cache", f"data.root={companion_cache}", f"model.in_channels={Z_DIM}",
                          f"model.text_dim={TEXT_DIM}", "model.vace_mask_channels=64", "cond.control=true",
                          "loss.reduction=sample_mean", *extra])
    cfg.optim.max_grad_norm = 0.05
    return cfg
