"""Wan 2.2 through the packed path: TI2V-5B (per-token timesteps, the 16x VAE) and A14B's two
experts (model.expert, boundary_ratio).

1. TI2V: the packed model with clean first-frame tokens (cond.feed=timestep) equals diffusers'
   own forward with per-token timesteps (WanPipeline's expand_timesteps), clip by clip.
2. A14B: our sampler over `ExpertPair` equals diffusers' WanPipeline(transformer, transformer_2,
   boundary_ratio) from the same noise; an expert's flow times lie in its range; pretrained
   pipeline folders give each expert its subfolder; what does not fit is named.
3. The Wan 2.2 VAE (AutoencoderKLWan, residual, patch 2: 16x spatial) in the latent cache's codec.
"""
from __future__ import annotations

import json

import pytest
import torch

from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from dit_train.models.wan_experts import ExpertPair, check_pair, timestep_range
from dit_train.tasks.video import patchify, unpatchify
from tests.families import SHAPES, random_model
from tests.test_wan import pack, tiny_wan_cfg



def test_ti2v_per_token_timesteps_match_diffusers_expand_timesteps():
    """First latent frame given clean: its tokens at timestep 0, the rest at 1000·t, as
    WanPipeline(expand_timesteps=True) builds `timestep` [1, seq_len] for TI2V image-to-video."""
    cfg = tiny_wan_cfg(in_channels=8)
    ours = random_model(cfg)
    ref = to_diffusers(ours.state_dict(), cfg)
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(8, *s, generator=g) for s in SHAPES]
    t = torch.tensor([0.7, 0.35])
    context, context_len = torch.randn(2, 5, 32, generator=g), torch.tensor([4, 5])
    x, pos, seg, meta = pack(clips, pad=2)
    clean = (pos[:, 0] == 0) & (seg >= 0)  # the first latent frame of each clip
    with torch.no_grad():
        out = ours(x, pos, seg, t, meta, context, context_len, clean=clean)
        off = 0
        for i, clip in enumerate(clips):
            grid = (clip.shape[1], clip.shape[2] // 2, clip.shape[3] // 2)
            n = grid[0] * grid[1] * grid[2]
            ts = (~clean[off:off + n]).float() * t[i] * 1000  # diffusers' token order is ours: (f, h, w)
            ctx = torch.nn.functional.pad(context[i:i + 1, :context_len[i]], (0, 0, 0, cfg.text_len - int(context_len[i])))
            theirs = ref(clip[None], ts[None], ctx).sample[0]
            torch.testing.assert_close(unpatchify(out[off:off + n], grid, (1, 2, 2), 8), theirs, rtol=1e-5, atol=1e-5)
            off += n


def _sampled(model, shape, context, steps, guidance=1.0, guidance_2=0.0, boundary=0.0, null=None):
    from dit_train.config.schema import ParallelConfig
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling import VideoSampler
    from dit_train.tasks.video_inputs import VideoInputs
    from dit_train.sampling.sampler import SampleRequest

    req = SampleRequest("p", shape, "", context, noise_id=0)
    sampler = VideoSampler([req], VideoInputs((1, 2, 2), text_dim=context.shape[-1]), null, init_parallel(ParallelConfig(device="cpu")),
                           steps, guidance, 0, guidance_scale_2=guidance_2, boundary=boundary)
    return sampler.sample(model)[0]


def test_expert_pair_samples_like_wan_pipeline_with_transformer_2():
    """Same noise, same Euler grid (shift 1, no CFG): our sampler switching experts per clip at
    the boundary gives diffusers' WanPipeline(transformer=high, transformer_2=low, boundary_ratio)
    latents; each expert alone gives something else (the switch matters)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from dit_train.rng import sample_generator

    cfg = tiny_wan_cfg()
    high, low = random_model(cfg, seed=1).eval(), random_model(cfg, seed=2).eval()
    boundary, steps, shape = 0.6, 4, (4, 2, 4, 4)
    ctx = torch.randn(cfg.text_len, 32, generator=torch.Generator().manual_seed(3))
    ours = _sampled(ExpertPair(high, low, boundary), shape, ctx, steps)

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=to_diffusers(high.state_dict(), cfg), transformer_2=to_diffusers(low.state_dict(), cfg),
                       boundary_ratio=boundary)
    noise = torch.randn(shape, generator=sample_generator(0, 0, 0, "sampling"))[None]
    theirs = pipe(prompt_embeds=ctx[None], num_frames=4 * (shape[1] - 1) + 1, height=8 * shape[2], width=8 * shape[3],
                  num_inference_steps=steps, guidance_scale=1.0, latents=noise, output_type="latent").frames[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for alone in (high, low):
        assert (_sampled(alone, shape, ctx, steps) - theirs).abs().max() > 1e-2


def test_guidance_scale_2_samples_like_wan_pipeline():
    """Classifier-free guidance with guidance_scale on the high-noise expert's steps and
    guidance_scale_2 on the low-noise expert's (diffusers' WanPipeline semantics, its
    negative_prompt_embeds = our null caption): the same latents; one scale for both differs."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from dit_train.rng import sample_generator

    cfg = tiny_wan_cfg()
    high, low = random_model(cfg, seed=1).eval(), random_model(cfg, seed=2).eval()
    boundary, steps, shape = 0.6, 4, (4, 2, 4, 4)
    g = torch.Generator().manual_seed(3)
    ctx, null = torch.randn(cfg.text_len, 32, generator=g), torch.randn(cfg.text_len, 32, generator=g)
    pair = ExpertPair(high, low, boundary)
    ours = _sampled(pair, shape, ctx, steps, guidance=3.0, guidance_2=1.5, boundary=boundary, null=null)

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=to_diffusers(high.state_dict(), cfg), transformer_2=to_diffusers(low.state_dict(), cfg),
                       boundary_ratio=boundary)
    noise = torch.randn(shape, generator=sample_generator(0, 0, 0, "sampling"))[None]
    theirs = pipe(prompt_embeds=ctx[None], negative_prompt_embeds=null[None], num_frames=4 * (shape[1] - 1) + 1,
                  height=8 * shape[2], width=8 * shape[3], num_inference_steps=steps, guidance_scale=3.0,
                  guidance_scale_2=1.5, latents=noise, output_type="latent").frames[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    same = _sampled(pair, shape, ctx, steps, guidance=3.0, boundary=boundary, null=null)  # guidance_scale_2 = 3
    assert (same - theirs).abs().max() > 1e-3


def test_expert_pair_picks_each_clips_expert_in_one_pack():
    cfg = tiny_wan_cfg()
    high, low = random_model(cfg, seed=1), random_model(cfg, seed=2)
    g = torch.Generator().manual_seed(0)
    x, pos, seg, meta = pack([torch.randn(4, *s, generator=g) for s in SHAPES], pad=2)
    t = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        got = ExpertPair(high, low, 0.875)(x, pos, seg, t, meta)
        a, b = high(x, pos, seg, t, meta), low(x, pos, seg, t, meta)
    torch.testing.assert_close(got[seg == 0], a[seg == 0], rtol=0, atol=0)
    torch.testing.assert_close(got[seg == 1], b[seg == 1], rtol=0, atol=0)


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform"])
def test_expert_flow_times_are_the_whole_draw_conditioned_on_its_range(tiny_cfg, sampling):
    """model.expert=high draws t in [b, 1], low in [0, b], from the shifted distribution
    conditioned on that range: its quantiles are those of whole-range draws that fall there."""
    from dataclasses import replace

    from dit_train.objectives.flow_matching import noisy_sample

    loss = replace(tiny_cfg.loss, timestep_sampling=sampling)
    x0, n, shift = torch.zeros(1, 1, 1, 1), 1500, 5.0
    whole = torch.tensor([noisy_sample(x0, 0, sid, 0, loss, shift)[2] for sid in range(4 * n)], dtype=torch.float64)
    for expert, (lo, hi) in (("high", (0.875, 1.0)), ("low", (0.0, 0.875))):
        cfg = tiny_wan_cfg(expert=expert, boundary_ratio=0.875)
        assert timestep_range(cfg) == cfg.timestep_range() == (lo, hi)
        ts = torch.tensor([noisy_sample(x0, 0, sid, 0, loss, shift, cfg.timestep_range())[2] for sid in range(n)],
                          dtype=torch.float64)
        assert lo <= float(ts.min()) and float(ts.max()) <= hi
        inside = whole[(whole >= lo) & (whole <= hi)]
        q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64)
        assert torch.allclose(ts.quantile(q), inside.quantile(q), atol=0.03 * (hi - lo)), (expert, ts.quantile(q), inside.quantile(q))
    assert timestep_range(tiny_wan_cfg()) == (0.0, 1.0)


def test_pretrained_pipeline_folder_gives_each_expert_its_subfolder(tmp_path):
    high_cfg = tiny_wan_cfg(expert="high", boundary_ratio=0.875)
    low_cfg = tiny_wan_cfg(expert="low", boundary_ratio=0.875)
    pipe = tmp_path / "a14b"
    for sub, seed in (("transformer", 1), ("transformer_2", 2)):
        to_diffusers(random_model(high_cfg, seed).state_dict(), high_cfg).save_pretrained(str(pipe / sub))
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875}))
    for cfg, seed in ((high_cfg, 1), (low_cfg, 2)):
        want = random_model(high_cfg, seed).state_dict()
        got = read_pretrained(str(pipe), cfg)
        assert all(torch.equal(got[k], want[k]) for k in want), cfg.expert

    # what does not fit, named: another boundary, a single-transformer pipeline, no transformer_2/
    with pytest.raises(ValueError, match=r"boundary_ratio=0.875 \(model_index.json\).*model.boundary_ratio=0.9"):
        read_pretrained(str(pipe), tiny_wan_cfg(expert="low", boundary_ratio=0.9))
    ti2v = tmp_path / "ti2v"
    to_diffusers(random_model(high_cfg).state_dict(), high_cfg).save_pretrained(str(ti2v / "transformer"))
    (ti2v / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": None,
                                                       "expand_timesteps": True}))
    with pytest.raises(ValueError, match="single-transformer pipeline.*not Wan 2.2 A14B"):
        read_pretrained(str(ti2v), low_cfg)
    (ti2v / "model_index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no transformer_2/config.json.*model.expert=low"):
        read_pretrained(str(ti2v), low_cfg)
    # another size: the keys that differ
    with pytest.raises(ValueError, match=r"num_attention_heads=2 \(model.heads gives 4\)"):
        read_pretrained(str(pipe), tiny_wan_cfg(expert="high", boundary_ratio=0.875, heads=4))


def test_expert_pair_refuses_runs_that_are_not_one_models_experts():
    high, low = tiny_wan_cfg(expert="high", boundary_ratio=0.875), tiny_wan_cfg(expert="low", boundary_ratio=0.875)
    check_pair(high, low, "a", "b")
    with pytest.raises(ValueError, match="--low-noise b trained model.expert=high"):
        check_pair(high, high, "a", "b")
    with pytest.raises(ValueError, match=r"a trained model.expert=\(none\)"):
        check_pair(tiny_wan_cfg(), low, "a", "b")
    from dit_train.models import model_config

    with pytest.raises(ValueError, match=r"--low-noise b trained model.expert=\(none\)"):  # not a Wan run at all
        check_pair(high, model_config("dit"), "a", "b")
    with pytest.raises(ValueError, match="boundary_ratio=0.875 but --low-noise b 0.9"):
        check_pair(high, tiny_wan_cfg(expert="low", boundary_ratio=0.9), "a", "b")
    with pytest.raises(ValueError, match=r"model.depth=2 vs 3"):
        check_pair(high, tiny_wan_cfg(expert="low", boundary_ratio=0.875, depth=3), "a", "b")


def test_expert_keys_are_checked():
    from dit_train.models import model_spec

    cfg = tiny_wan_cfg(expert="middle")
    assert model_spec(cfg).checks(cfg) == ["model.expert='middle' must be high, low, both or empty (one transformer "
                                           "for every t)"]
    cfg = tiny_wan_cfg(expert="low")
    assert "needs model.boundary_ratio in (0, 1)" in model_spec(cfg).checks(cfg)[0]


def test_both_experts_refuse_what_does_not_fit(tmp_path):
    """model.expert=both: no boundary, a single transformer folder as its pretrained weights, a
    --low-noise partner; --guidance-scale-2 for a model of one transformer: one line each."""
    import argparse

    from dit_train.models import model_spec
    from dit_train.tools.sample import expert_boundary

    cfg = tiny_wan_cfg(expert="both")
    assert model_spec(cfg).checks(cfg) == ["model.expert=both needs model.boundary_ratio in (0, 1) (Wan 2.2 A14B "
                                           "T2V: 0.875), got 0.0"]
    cfg = tiny_wan_cfg(expert="both", boundary_ratio=0.875)
    assert model_spec(cfg).checks(cfg) == []
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="is one transformer, but model.expert=both trains Wan 2.2 A14B's two experts"):
        read_pretrained(str(tmp_path), cfg)
    with pytest.raises(ValueError, match="b trained model.expert=both: it holds both experts"):
        check_pair(tiny_wan_cfg(expert="high", boundary_ratio=0.875), cfg, "a", "b")
    one = argparse.Namespace(model=tiny_wan_cfg(expert="high", boundary_ratio=0.875))
    with pytest.raises(ValueError, match="--guidance-scale-2 guides Wan 2.2 A14B's low-noise expert"):
        expert_boundary(argparse.Namespace(low_noise=None, guidance_scale_2=2.0), one)
    assert expert_boundary(argparse.Namespace(low_noise=None, guidance_scale_2=2.0), argparse.Namespace(model=cfg)) == 0.875


def test_wan22_vae_compresses_16x_in_the_latent_cache_codec(tmp_path):
    """A tiny Wan 2.2 VAE (residual blocks, patch 2 before the 8x encoder, z_dim 48's layout):
    VaeCodec reads its 16x spatial / 4x temporal compression and per-channel statistics."""
    from diffusers import AutoencoderKLWan

    from dit_train.data_pipelines.latent_cache import VaeCodec

    z = 6
    AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True], is_residual=True, patch_size=2, scale_factor_spatial=16,
                     scale_factor_temporal=4, in_channels=12, out_channels=12,
                     latents_mean=[0.1 * i for i in range(z)], latents_std=[1.0 + i for i in range(z)]
                     ).save_pretrained(str(tmp_path / "vae"))
    vae = VaeCodec(str(tmp_path / "vae"))
    assert (vae.spatial, vae.temporal, vae.latent_channels) == (16, 4, z)
    pixels = torch.rand(3, 5, 32, 48) * 2 - 1
    lat = vae.encode(pixels)
    assert lat.shape == (z, 2, 2, 3) == vae.latent_shape(5, 32, 48)
    assert vae.decode(lat).shape == (3, 5, 32, 48)
