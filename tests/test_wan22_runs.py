"""Wan 2.2 training runs on the tiny presets: layout exactness (1 process vs dp x CP, uneven
clips) for TI2V full training and for an A14B expert's LoRA; exports that diffusers'
WanPipeline loads and samples with; the planner's clip sizes; refused resumes.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dit_train.engine.layout_equivalence import relative_difference, run_layouts
from tests.conftest import TINY, compose_config, train_in_process

# small clips at patch [1, 2, 2] (diffusers' WanPipeline builds TI2V's per-token timesteps on a
# [::2, ::2] latent grid, so the exported model must have Wan's patch); uneven sizes
SMALL = ["model.patch_size=[1,2,2]", "data.widths=[32]", "data.heights=[8,12]", "data.frames=[1,3]",
         "model.text_len=8", "train.micro_batch_tokens=300"]
TI2V = ["model=wan22_ti2v_tiny", *TINY, *SMALL, "cond.kind=first_frame", "cond.feed=timestep", "cond.prob=0.5"]
LOW = ["model=wan22_a14b_tiny", "model.expert=low", *TINY, *SMALL, "model.lora.rank=4", "model.lora.alpha=8"]


def _check_layouts(cfg, layouts):
    from dit_train.data_pipelines import prepare_data

    prepare_data(cfg.data, cfg.model)
    runs = run_layouts(cfg, ["1", *layouts], ["sample_mean"])
    (oracle,) = runs.pop("1")
    for spec, (got,) in runs.items():
        rel = relative_difference(oracle, got)
        assert rel <= 1e-4, f"{spec}: weights differ by {rel:.2e} of the update"
    return oracle


@pytest.mark.slow
def test_layouts_ti2v_full_and_a14b_expert_lora(data_cache):
    """Same weights after 2 SGD steps: TI2V full training (first frame clean at timestep 0 on
    half the samples, packs split inside clips, RoPE of each token's own position) under ring
    CP=2; the low-noise expert's LoRA (its t drawn below the boundary) under FSDP2 dp_shard=2, the
    frozen base unmoved. (Ulysses and FSDP2 with a meta build on the same model class:
    tests/test_wan.py.)"""
    _check_layouts(compose_config(TI2V, cache_dir=data_cache), ["cp_ring=2"])
    ref = _check_layouts(compose_config(LOW, cache_dir=data_cache), ["dp_shard=2"])
    assert [k for k in ref if ".lora_" in k and not k.startswith("__")]
    assert all(torch.equal(ref[k], ref[f"__init__/{k}"]) for k in ref if not k.startswith("__") and ".lora_" not in k)


def test_ti2v_run_exports_to_wan_pipeline_expand_timesteps(data_cache, tmp_path):
    """A TI2V run's --diffusers export in WanPipeline(expand_timesteps=True) samples the clip our
    sampler samples from the same noise (shift 1, no CFG), to 1e-4."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from dit_train.models import build_model
    from dit_train.tools import export_weights
    from tests.test_wan22 import _sampled
    from dit_train.rng import sample_generator

    run = tmp_path / "run"
    train_in_process([*TI2V, "train.steps=1", "cond.kind=none"], run, cache_dir=data_cache)
    assert export_weights.main([str(run), "--diffusers", str(tmp_path / "ti2v")]) == 0
    transformer = WanTransformer3DModel.from_pretrained(str(tmp_path / "ti2v"))
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=transformer, expand_timesteps=True)
    cfg = compose_config([*TI2V, "cond.kind=none"])
    ours = build_model(cfg.model)
    ours.load_state_dict(transformer.state_dict())
    shape, ctx = (3, 2, 4, 6), torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    mine = _sampled(ours.eval(), shape, ctx, 3)
    noise = torch.randn(shape, generator=sample_generator(0, 0, 0, "sampling"))[None]
    theirs = pipe(prompt_embeds=ctx[None], num_frames=5, height=32, width=48, num_inference_steps=3, guidance_scale=1.0,
                  latents=noise, output_type="latent").frames[0]
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_a14b_expert_lora_loads_into_transformer_2(data_cache, tmp_path, capsys):
    """The low-noise expert's LoRA run: --base and the adapters export into transformer_2/;
    WanPipeline(transformer, transformer_2, boundary_ratio).load_lora_weights(...,
    load_into_transformer_2=True) gives our merged weights' outputs, and the pipeline samples;
    tools.sample --low-noise samples with both experts (and refuses them the wrong way round);
    resuming the run as the other expert is refused, naming model.expert."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from dit_train.models import build_model
    from dit_train.models.wan import to_diffusers
    from dit_train.tasks.video import patchify, unpatchify
    from dit_train.kernels import VarlenLayout
    from dit_train.tools import export_weights

    run = tmp_path / "run"
    train_in_process([*LOW, "train.steps=2", "train.ckpt_every=2"], run, cache_dir=data_cache)
    out = tmp_path / "a14b"
    assert export_weights.main([str(run), "--base", "--diffusers", str(out)]) == 0
    assert export_weights.main([str(run), "--diffusers", str(out)]) == 0
    assert (out / "transformer_2" / "config.json").is_file()
    assert (out / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()

    cfg = compose_config(LOW)
    cfg.model.lora.rank = 0
    high = to_diffusers(build_model(cfg.model).state_dict(), cfg.model)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=high, transformer_2=WanTransformer3DModel.from_pretrained(str(out / "transformer_2")),
                       boundary_ratio=0.875)
    pipe.load_lora_weights(str(out / "transformer_2"), load_into_transformer_2=True)
    ours = build_model(cfg.model)
    ours.load_state_dict(load_file(str(run / "weights.safetensors")))  # base + adapters merged
    clip = torch.randn(3, 2, 4, 6, generator=torch.Generator().manual_seed(5))
    ctx = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(6))
    tok, grid = patchify(clip, (1, 2, 2))
    seg = torch.zeros(tok.shape[0], dtype=torch.long)
    with torch.no_grad():
        mine = ours(tok, grid, seg, torch.tensor([0.4]), VarlenLayout.build(seg, torch.arange(len(seg)), False), ctx,
                    torch.tensor([8]))
        theirs = pipe.transformer_2(clip[None], torch.tensor([400.0]), ctx).sample[0]
    mine = unpatchify(mine, grid_size := (2, 2, 3), (1, 2, 2), 3)
    assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5, grid_size
    video = pipe(prompt_embeds=ctx, num_frames=5, height=32, width=48, num_inference_steps=2, guidance_scale=1.0,
                 output_type="latent").frames
    assert video.shape == (1, 3, 2, 4, 6) and torch.isfinite(video).all()

    # tools.sample: the high-noise expert's run with --low-noise this one; the wrong way round refused
    from dit_train.tools import sample

    high_run = tmp_path / "high"
    train_in_process([*LOW, "model.expert=high", "train.steps=1"], high_run, cache_dir=data_cache)
    assert sample.main([str(run), "--low-noise", str(high_run), "--prompt", "x"]) == 2
    assert "trained model.expert=low: the run sampled first must be the high-noise expert" in capsys.readouterr().err
    args = ["--prompt", "a red square", "--frames", "2", "--height", "8", "--width", "32", "--steps", "4", "--out"]
    assert sample.main([str(high_run), "--low-noise", str(run), *args, str(tmp_path / "both")]) == 0
    assert sample.main([str(high_run), *args, str(tmp_path / "high_only")]) == 0
    both = load_file(str(tmp_path / "both" / "samples.safetensors"))
    alone = load_file(str(tmp_path / "high_only" / "samples.safetensors"))
    assert both.keys() == alone.keys() and any((both[k] - alone[k]).abs().max() > 1e-4 for k in both)

    # the same run folder resumed as the high-noise expert: refused before step 0, naming the key
    with pytest.raises(Exception, match="model.expert: the checkpoint was trained with 'low', this run asks for 'high'"):
        train_in_process([*LOW, "model.expert=high", "train.steps=3", "train.resume=auto"], run, cache_dir=data_cache)


def test_planner_sizes_clips_with_the_models_vae(capsys):
    """tools.plan --frames takes the VAE stride from the model: Wan 2.2 TI2V's 16x."""
    from dit_train.planning.clips import clip_tokens
    from dit_train.tools.plan import main

    cfg = compose_config(["model=wan22_ti2v_5b"])
    assert clip_tokens(cfg.model, 121, 704, 1280, tuple(cfg.model.vae_stride)) == 31 * 22 * 40
    assert main(["model=wan22_ti2v_tiny", "model.patch_size=[1,2,2]", "--world", "1", "--device", "cpu",
                 "--frames", "9", "--height", "64", "--width", "64", "--max-frames", "9", "--gpu-mem-gib", "4"]) in (0, 1)
    assert "latents (3, 4, 4) (VAE stride 4,16,16) -> 12 tokens" in capsys.readouterr().out
