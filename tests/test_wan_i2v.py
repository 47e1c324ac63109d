"""diffusers' Wan 2.1 I2V layout through the packed path (model=wan_i2v_*, docs/wan.md#wan-21-i2v).

1. The packed model with the I2V input (noisy | 4 mask channels | condition latents) and the CLIP
   image branch (per-clip image tokens, FLF2V's two images too) equals diffusers'
   WanTransformer3DModel run clip by clip on the same 36-channel-style input (forward and grads).
2. model.pretrained: a diffusers I2V folder loads 1:1; a T2V folder for an I2V config and an I2V
   folder for a T2V config are refused in one line naming the keys.
"""
from __future__ import annotations

import pytest
import torch

from dit_train.models import model_config
from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from tests.families import PATCH, SHAPES, random_model, assert_matches_diffusers_per_clip
from tests.test_wan import pack

IMAGE_DIM, IMAGE_TOKENS, TEXT_LEN = 24, 5, 512  # diffusers' I2V processor splits off 512 text tokens


def tiny_i2v_cfg(**kw):
    base = dict(dim=32, heads=2, depth=2, ffn_dim=64, freq_dim=32, text_dim=32, text_len=TEXT_LEN, in_channels=4,
                cond_channels=8, mask_channels=4, image_dim=IMAGE_DIM, patch_size=list(PATCH), init="normal")
    return model_config("wan", **(base | kw))


@pytest.mark.parametrize("flf", [False, True], ids=["i2v", "flf2v"])
def test_i2v_layout_with_image_tokens_matches_diffusers_per_clip(flf):
    """Two clips of different sizes, each with its own caption and image tokens, packed with
    padding: each clip's output and the weight gradients equal diffusers' on that clip alone."""
    n_img = 2 * IMAGE_TOKENS if flf else IMAGE_TOKENS
    cfg = tiny_i2v_cfg(pos_embed_seq_len=n_img if flf else 0)
    ours = random_model(cfg)
    ref = to_diffusers(ours.state_dict(), cfg)
    assert ref.config.in_channels == 12 and ref.config.added_kv_proj_dim == 32 and ref.config.image_dim == IMAGE_DIM
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(12, *s, generator=g) for s in SHAPES]  # [noisy 4 | mask 4 | condition 4]
    t = torch.tensor([0.3, 0.85])
    context, context_len = torch.randn(2, 7, 32, generator=g), torch.tensor([3, 7])
    image = torch.randn(2, n_img, IMAGE_DIM, generator=g)
    x, pos, seg, meta = pack(clips, pad=3)
    out = ours(x, pos, seg, t, meta, context, context_len, image=image)

    def theirs(i, clip, grid):
        ctx = torch.nn.functional.pad(context[i:i + 1, :context_len[i]], (0, 0, 0, TEXT_LEN - int(context_len[i])))
        # the pipeline's FLF2V image embeds: [2 images, tokens, image_dim] per clip
        img = image[i].view(2, IMAGE_TOKENS, IMAGE_DIM) if flf else image[i:i + 1]
        return ref(clip[None], t[i:i + 1] * 1000, ctx, encoder_hidden_states_image=img).sample[0]

    assert_matches_diffusers_per_clip(ours, ref, out, clips, theirs, 4, g)
    with pytest.raises(ValueError, match="model.image_dim=24: the model needs each clip's CLIP image tokens"):
        ours(x, pos, seg, t, meta, context, context_len)


def test_pretrained_i2v_folder_loads_and_t2v_i2v_mismatches_are_refused(tmp_path):
    cfg = tiny_i2v_cfg(depth=1)
    model = random_model(cfg)
    to_diffusers(model.state_dict(), cfg).save_pretrained(str(tmp_path / "i2v"))
    state = read_pretrained(str(tmp_path / "i2v"), cfg)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    t2v_cfg = tiny_i2v_cfg(depth=1, image_dim=0, cond_channels=0, mask_channels=1)
    with pytest.raises(ValueError, match=r"image_dim=24 \(model.image_dim gives None\).*needs an I2V config: model=wan_i2v_14b"):
        read_pretrained(str(tmp_path / "i2v"), t2v_cfg)
    to_diffusers(random_model(t2v_cfg).state_dict(), t2v_cfg).save_pretrained(str(tmp_path / "t2v"))
    with pytest.raises(ValueError, match=r"image_dim=None \(model.image_dim gives 24\).*cannot start one"):
        read_pretrained(str(tmp_path / "t2v"), cfg)


@pytest.mark.parametrize("overrides,needle", [
    (["cond.kind=first_frame", "cond.feed=timestep"], r"model.mask_channels=4 is diffusers' Wan 2.1 I2V layout: it needs"),
    (["cond.kind=first_frame", "cond.feed=concat", "data=synthetic_video"],
     r"reads each clip's condition latents from a latent cache .* use data=latent_cache"),
    (["cond.kind=first_frame", "cond.feed=concat", "model.patch_size=[2,2,2]"], r"needs model.patch_size\[0\]=1"),
    (["cond.kind=first_frame", "cond.feed=concat", "model.mask_channels=1", "model.cond_channels=17"],
     r"model.image_dim=32 \(the CLIP image branch\) is Wan 2.1 I2V's: it needs its input layout"),
])
def test_i2v_config_mistakes_are_refused_before_the_run(overrides, needle):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from tests.conftest import compose_config

    data = [] if "data=synthetic_video" in overrides else ["data=latent_cache", "data.root=latents/"]
    with pytest.raises(ConfigError, match=needle):
        check_config(compose_config(["model=wan_i2v_tiny", *data, *overrides]))
