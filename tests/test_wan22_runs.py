"""Wan 2.2 training runs on the tiny presets: layout exactness (1 process vs dp x CP, uneven
clips) for TI2V full training and LoRA and for an A14B expert's LoRA; exports that diffusers'
WanPipeline loads and samples with; the planner's clip sizes; refused resumes.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dit_train.engine.layout_equivalence import apply_layout, parse_layout, relative_difference, train_on_workers
from tests.conftest import TINY, compose_config, train_in_process

# small clips at patch [1, 2, 2] (diffusers' WanPipeline builds TI2V's per-token timesteps on a
# [::2, ::2] latent grid, so the exported model must have Wan's patch); uneven sizes
SMALL = ["model.patch_size=[1,2,2]", "data.widths=[32]", "data.heights=[8,12]", "data.frames=[1,3]",
         "model.text_len=8", "train.micro_batch_tokens=300"]
TI2V = ["model=wan22_ti2v_tiny", *TINY, *SMALL, "cond.kind=first_frame", "cond.feed=timestep", "cond.prob=0.5"]
TI2V_LORA = [*TI2V, "model.lora.rank=4", "model.lora.alpha=8"]
LOW = ["model=wan22_a14b_tiny", "model.expert=low", *TINY, *SMALL, "model.lora.rank=4", "model.lora.alpha=8"]
# both experts in one run; boundary 0.5 so that the 2 x 6 clips fall on both sides and some
# rank of dp_shard=2 holds clips of one expert only in some step (checked when the test was written)
BOTH = ["model=wan22_a14b_tiny", "model.expert=both", "model.boundary_ratio=0.5", *TINY, *SMALL]
BOTH_LORA = [*BOTH, "model.lora.rank=4", "model.lora.alpha=8"]


def _check_layouts(*cases):
    """cases: (cfg, [layout, ...]); every layout's weights after the run equal the one-process
    run's to 1e-4 of the update. One launch per world size for all cases (they share workers).
    Returns the one-process results, one per case."""
    from dit_train.data_pipelines import prepare_data

    cfgs, where = [], []
    for i, (cfg, layouts) in enumerate(cases):
        prepare_data(cfg.data, cfg.model)
        for spec in ["1", *layouts]:
            cfgs.append(apply_layout(cfg, parse_layout(spec), "sample_mean"))
            where.append((i, spec))
    got = train_on_workers(cfgs)
    oracles = {i: res for (i, spec), res in zip(where, got) if spec == "1"}
    for (i, spec), res in zip(where, got):
        rel = relative_difference(oracles[i], res)
        assert rel <= 1e-4, f"case {i} {spec}: weights differ by {rel:.2e} of the update"
    return [oracles[i] for i in range(len(cases))]


@pytest.mark.slow
def test_layouts_ti2v_full_and_a14b_expert_lora(data_cache):
    """Same weights after 2 SGD steps: TI2V full training (first frame clean at timestep 0 on
    half the samples, packs split inside clips, RoPE of each token's own position) under ring
    CP=2, and TI2V's LoRA on the same clips and layout (TI2V's shape: 48 channels, per-token
    timesteps); the low-noise expert's LoRA (its t drawn below the boundary) under FSDP2
    dp_shard=2; the frozen base of each LoRA run unmoved; both A14B experts in one run (each clip routed by its t, uneven clips,
    a rank holding clips of one expert only in the first step: both experts still run on every
    rank) under FSDP2 dp_shard=2, and their LoRA under Ulysses CP=2 (one launch of 2 workers for
    all of it; dp_shard=2,cp_ulysses=2 for both experts passed too when this was written, but
    a 4-worker launch costs about a minute more on 2 cores). (Ulysses and FSDP2 with a meta build on the same model class:
    tests/test_wan.py.)"""
    # one transformer block: the runs are Python-bound, and the CP splits, per-token timesteps,
    # shards, adapters and expert routing checked here need no second block
    one_block = ["model.depth=1"]
    ti2v, ti2v_lora, low, both, both_lora = _check_layouts(
        (compose_config([*TI2V, *one_block], cache_dir=data_cache), ["cp_ring=2"]),
        (compose_config([*TI2V_LORA, *one_block], cache_dir=data_cache), ["cp_ring=2"]),
        (compose_config([*LOW, *one_block], cache_dir=data_cache), ["dp_shard=2"]),
        (compose_config([*BOTH, *one_block], cache_dir=data_cache), ["dp_shard=2"]),
        (compose_config([*BOTH_LORA, *one_block], cache_dir=data_cache), ["cp_ulysses=2"]))
    for ref in (ti2v_lora, low, both_lora):  # adapters moved (the comparison is not vacuous), base did not
        adapters = [k for k in ref if ".lora_" in k and not k.startswith("__")]
        assert adapters and any(not torch.equal(ref[k], ref[f"__init__/{k}"]) for k in adapters)
        assert all(torch.equal(ref[k], ref[f"__init__/{k}"]) for k in ref if not k.startswith("__") and ".lora_" not in k)
    for ref in (both, both_lora):  # clips on both sides: each expert trained (not a vacuous comparison)
        for expert in ("transformer.", "transformer_2."):
            moved = [k for k in ref if k.startswith(expert) and ".lora_B" in k or k == f"{expert}proj_out.weight"]
            assert moved and any(not torch.equal(ref[k], ref[f"__init__/{k}"]) for k in moved), expert


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
    from dit_train.models.diffusers_family import to_diffusers
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


def test_a14b_both_experts_run_exports_resumes_and_samples_like_wan_pipeline(data_cache, tmp_path, capsys):
    """model.expert=both with LoRA: the run writes one adapter file per expert (lora/transformer/,
    lora/transformer_2/); `export_weights --base` and `--diffusers` give the pipeline layout, which
    WanPipeline(transformer, transformer_2, boundary_ratio) loads (the low-noise adapters with
    load_into_transformer_2=True) and samples the latents our sampler samples from the run's
    merged weights (guidance_scale on the high-noise steps, guidance_scale_2 on the low-noise
    ones); `--merge-lora` exports both merged experts; resuming from the first checkpoint gives the
    uninterrupted run's weights, EMA and adapter files; tools.sample switches experts and takes
    --guidance-scale-2."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from dit_train.models import build_model
    from dit_train.rng import sample_generator
    from dit_train.tools import export_weights, sample
    from tests.test_wan22 import _sampled

    run, resumed, out = tmp_path / "run", tmp_path / "resumed", tmp_path / "a14b"
    both = [*BOTH_LORA, "train.ema_decay=0.9"]
    train_in_process([*both, "train.ckpt_every=1"], run, cache_dir=data_cache)
    train_in_process([*both, f"train.resume={run / 'checkpoints' / 'step_00000000'}"], resumed, cache_dir=data_cache)
    files = ["weights.safetensors", "weights_ema.safetensors", *(f"lora{e}/{sub}/pytorch_lora_weights.safetensors"
                                                                for e in ("", "_ema") for sub in ("transformer", "transformer_2"))]
    for name in files:
        a, b = load_file(str(run / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6, name

    assert export_weights.main([str(run), "--base", "--diffusers", str(out)]) == 0
    assert export_weights.main([str(run), "--diffusers", str(out)]) == 0
    assert export_weights.main([str(run), "--merge-lora", "--diffusers", str(tmp_path / "merged")]) == 0
    merged = load_file(str(run / "weights.safetensors"))
    for sub in ("transformer", "transformer_2"):
        assert (out / sub / "config.json").is_file() and (out / sub / "pytorch_lora_weights.safetensors").is_file()
        full = WanTransformer3DModel.from_pretrained(str(tmp_path / "merged" / sub)).state_dict()
        assert all(torch.equal(full[k], merged[f"{sub}.{k}"]) for k in full)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=WanTransformer3DModel.from_pretrained(str(out / "transformer")),
                       transformer_2=WanTransformer3DModel.from_pretrained(str(out / "transformer_2")),
                       boundary_ratio=0.5)
    pipe.load_lora_weights(str(out / "transformer"))
    pipe.load_lora_weights(str(out / "transformer_2"), load_into_transformer_2=True)

    cfg = compose_config(BOTH)  # the run's model without adapters: its merged weights
    ours = build_model(cfg.model)
    ours.load_state_dict(merged)
    shape, g = (3, 2, 4, 6), torch.Generator().manual_seed(1)
    ctx, null = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    mine = _sampled(ours.eval(), shape, ctx, 4, guidance=3.0, guidance_2=1.5, boundary=0.5, null=null)
    noise = torch.randn(shape, generator=sample_generator(0, 0, 0, "sampling"))[None]
    theirs = pipe(prompt_embeds=ctx[None], negative_prompt_embeds=null[None], num_frames=5, height=32, width=48,
                  num_inference_steps=4, guidance_scale=3.0, guidance_scale_2=1.5, latents=noise,
                  output_type="latent").frames[0]
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)

    args = ["--prompt", "a red square", "--frames", "2", "--height", "8", "--width", "32", "--steps", "4", "--out"]
    assert sample.main([str(run), *args, str(tmp_path / "g2"), "--guidance-scale-2", "1.5"]) == 0
    assert sample.main([str(run), *args, str(tmp_path / "g")]) == 0
    a, b = load_file(str(tmp_path / "g2" / "samples.safetensors")), load_file(str(tmp_path / "g" / "samples.safetensors"))
    assert any((a[k] - b[k]).abs().max() > 1e-4 for k in a)
    assert sample.main([str(run), "--low-noise", str(run), "--prompt", "x"]) == 2
    assert "trained model.expert=both: it holds both experts" in capsys.readouterr().err

