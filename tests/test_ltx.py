"""diffusers' LTXVideoTransformer3DModel (LTX-Video) through our packed path (model.name=ltx).

1. The packed model equals diffusers' own forward run clip by clip on LTXPipeline's tokens
   (forward and every weight gradient; masked captions; per-token timesteps of clean tokens).
2. Diffusers folders: a LoRA run's file loads in LTXVideoTransformer3DModel and LTXPipeline; a
   folder of another family or size is refused before the run, in one line (load, train, export,
   sample: tests/test_diffusers_families.py).
3. Layout invariance (full training and LoRA): 1 process vs dp × CP layouts, uneven clips.
4. Latent cache with LTX-Video's VAE (statistics in buffers) and a T5 text encoder, trained on.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dit_train.engine.layout_equivalence import relative_difference, run_layouts
from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, model_config
from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from dit_train.tasks.video import patchify
from tests.conftest import TINY, compose_config
from tests.families import family_run_cfg, PATCH, pretrained_folder, random_model, SHAPES, assert_grads_match

SCALE = (0.32, 32.0, 32.0)


def tiny_ltx_cfg(**kw):
    # dim 32: 32 % 6 = 2 channels RoPE leaves unrotated (diffusers' padding path is exercised)
    base = dict(dim=32, heads=2, depth=2, text_dim=24, text_len=6, in_channels=4, patch_size=list(PATCH), init="normal")
    return model_config("ltx", **(base | kw))


def ltx_tokens(clip: torch.Tensor, patch=PATCH) -> torch.Tensor:
    """LTXPipeline's own tokens of a clip [C, F, H, W]: [F'·H'·W', C·pt·p·p]."""
    from diffusers import LTXPipeline

    return LTXPipeline._pack_latents(clip[None], patch[1], patch[0])[0]


def one_clip_meta(n: int):
    seg = torch.zeros(n, dtype=torch.long)
    return seg, VarlenLayout.build(seg, torch.arange(n), False)


@pytest.mark.parametrize("clean", [False, True], ids=["noisy", "clean_tokens"])
def test_packed_forward_and_grads_match_diffusers_per_clip(clean):
    cfg = tiny_ltx_cfg()
    ours = random_model(cfg)
    ref = to_diffusers(ours.state_dict(), cfg)  # diffusers' own module, same weights
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(4, *s, generator=g) for s in SHAPES]
    t = torch.tensor([0.3, 0.85])
    context, context_len = torch.randn(2, 5, 24, generator=g), torch.tensor([3, 5])
    toks, pos, seg = [], [], []
    for i, c in enumerate(clips):
        tk, grid = patchify(c, PATCH)
        toks.append(tk), pos.append(grid), seg.append(torch.full((tk.shape[0],), i))
    pad = 3
    x = torch.cat([*toks, torch.zeros(pad, toks[0].shape[1])])
    pos = torch.cat([*pos, torch.zeros(pad, 3, dtype=torch.long)])
    seg = torch.cat([*seg, torch.full((pad,), -1)])
    order = torch.cat([torch.arange(len(tk)) for tk in toks] + [torch.arange(pad)])
    clean_tok = (torch.arange(len(seg)) % 3 == 0) & (seg >= 0) if clean else None
    out = ours(x, pos, seg, t, VarlenLayout.build(seg, order, causal=False), context, context_len, clean=clean_tok)

    loss_ours, loss_ref, off = 0.0, 0.0, 0
    for i, clip in enumerate(clips):
        tokens = ltx_tokens(clip)
        assert torch.equal(tokens, toks[i])  # our patch features are LTXPipeline's token features
        n = tokens.shape[0]
        # LTXPipeline's call: timestep = 1000·t (per token with clean tokens at 0), the T5 padding
        # masked out (here garbage past the valid length), rope_interpolation_scale
        timestep = t[i:i + 1] * 1000
        if clean:
            timestep = torch.where(clean_tok[off:off + n], 0.0, timestep)[None]
        mask = (torch.arange(5) < context_len[i]).long()[None]
        grid = [s // p for s, p in zip(clip.shape[1:], PATCH)]
        theirs = ref(tokens[None], context[i:i + 1], timestep, mask, num_frames=grid[0], height=grid[1], width=grid[2],
                     rope_interpolation_scale=SCALE).sample[0]
        mine = out[off:off + n]
        off += n
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        probe = torch.randn(theirs.shape, generator=g)
        loss_ours = loss_ours + (mine * probe).sum()
        loss_ref = loss_ref + (theirs * probe).sum()
    assert out[off:].abs().max() < 1e3  # padding tokens: finite, ignored

    loss_ours.backward()
    loss_ref.backward()
    assert_grads_match(ours, ref)


def test_rope_follows_positions_and_context_none_is_one_zero_token():
    cfg = tiny_ltx_cfg()
    ours = random_model(cfg)
    tok, grid = patchify(torch.randn(4, 2, 4, 6, generator=torch.Generator().manual_seed(3)), PATCH)
    seg, meta = one_clip_meta(tok.shape[0])
    a = ours(tok, grid, seg, torch.tensor([0.5]), meta)
    b = ours(tok, grid, seg, torch.tensor([0.5]), meta, torch.zeros(1, 1, 24), torch.ones(1, dtype=torch.long))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - ours(tok, grid.flip(0), seg, torch.tensor([0.5]), meta)).abs().max() > 1e-3


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_keeps_outputs_and_gradients(policy):
    """Checkpointed blocks (the spec's transformer_blocks) recompute exactly what was run."""
    from dit_train.models import model_spec
    from dit_train.parallel.checkpointing import apply_activation_checkpointing

    cfg = tiny_ltx_cfg()
    plain, ckpt = random_model(cfg), random_model(cfg)
    apply_activation_checkpointing(model_spec(cfg).blocks(ckpt), policy)
    tok, grid = patchify(torch.randn(4, 2, 4, 6, generator=torch.Generator().manual_seed(4)), PATCH)
    seg, meta = one_clip_meta(tok.shape[0])
    ctx = torch.randn(1, 3, 24)
    outs = [m(tok, grid, seg, torch.tensor([0.6]), meta, ctx) for m in (plain, ckpt)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for out in outs:
        out.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


# --------------------------------------------------------------------------- folders, bad input


def test_pretrained_of_another_family_or_size_is_refused_before_the_run(tmp_path):
    """One line naming what does not fit, from check_config (config.json only, before step 0)."""
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from dit_train.models.diffusers_family import to_diffusers as wan_to_diffusers

    cfg = tiny_ltx_cfg()
    to_diffusers(random_model(cfg).state_dict(), cfg).save_pretrained(str(tmp_path / "ltx"))
    assert read_pretrained(str(tmp_path / "ltx"), cfg).keys() == random_model(cfg).state_dict().keys()
    with pytest.raises(ValueError, match=r"num_layers=2 \(model.depth gives 3\)"):
        read_pretrained(str(tmp_path / "ltx"), tiny_ltx_cfg(depth=3))
    wan_cfg = model_config("wan", dim=32, heads=2, depth=1, ffn_dim=64, freq_dim=32, text_dim=24, in_channels=4,
                           patch_size=list(PATCH))
    wan_to_diffusers(build_model(wan_cfg).state_dict(), wan_cfg).save_pretrained(str(tmp_path / "wan" / "transformer"))
    for folder, want in (("wan", "holds a WanTransformer3DModel, not an LTXVideoTransformer3DModel"),
                         ("ltx", r"attention_head_dim=16 \(model.dim / heads gives 8\)")):
        run = compose_config(["model=ltx_tiny", "model.dim=32", "model.heads=2", f"model.pretrained={tmp_path / folder}"])
        if folder == "ltx":
            run.model.heads = 4
        with pytest.raises(ConfigError, match=want) as err:
            check_config(run)
        assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def ltx_run_cfg(data_cache):
    return family_run_cfg(["model=ltx_tiny", "model.text_len=16"], data_cache)


@pytest.fixture(scope="module")
def pretrained_dir(ltx_run_cfg, tmp_path_factory):
    """A diffusers folder with random weights of ltx_tiny's shape (nothing downloaded)."""
    return pretrained_folder(ltx_run_cfg.model, tmp_path_factory.mktemp("ltx_pretrained"))


def same_outputs(cfg, weights, diffusers_model, ctx=None):
    """Our packed model with `weights` vs `diffusers_model` on one 2x16x24 pixel clip: max |diff| / max."""
    ours = build_model(replace(cfg, lora=replace(cfg.lora, rank=0)))
    ours.load_state_dict(weights)
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(3, 2, 16, 24, generator=g)
    ctx = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g) if ctx is None else ctx
    tok, grid = patchify(clip, tuple(cfg.patch_size))
    seg, meta = one_clip_meta(tok.shape[0])
    with torch.no_grad():
        mine = ours(tok, grid, seg, torch.tensor([0.4]), meta, ctx, torch.tensor([ctx.shape[1]]))
        theirs = diffusers_model(ltx_tokens(clip, tuple(cfg.patch_size))[None], ctx, torch.tensor([400.0]),
                                 torch.ones(1, ctx.shape[1]), num_frames=1, height=2, width=3,
                                 rope_interpolation_scale=tuple(cfg.rope_scale)).sample[0]
    return float((mine - theirs).abs().max() / theirs.abs().max())


@pytest.fixture(scope="module")
def ltx_lora_run(data_cache, pretrained_dir, tmp_path_factory):
    from tests.conftest import train_in_process

    run = tmp_path_factory.mktemp("ltx_lora") / "run"
    train_in_process(["+experiment=ltx_lora", *(o for o in TINY if not o.startswith("optim")), "model.text_len=16",
                      "train.steps=2", "train.sample_every=0", "train.ckpt_every=2", "model.lora.rank=4",
                      "model.lora.alpha=8", "optim.lr=0.05", f"model.pretrained={pretrained_dir}"], run,
                     cache_dir=data_cache)
    return run


def test_lora_run_loads_in_diffusers_with_matching_outputs(ltx_lora_run, pretrained_dir, tmp_path):
    """The run's diffusers LoRA file on diffusers' LTXVideoTransformer3DModel (load_lora_adapter) and
    in LTXPipeline (load_lora_weights) gives our packed model's outputs with the run's merged
    weights: relative error <= 1e-5; export_weights writes the same file."""
    from diffusers import LTXPipeline, LTXVideoTransformer3DModel
    from safetensors.torch import load_file

    from dit_train.compose import load_config
    from dit_train.tools import export_weights

    adapters = load_file(str(ltx_lora_run / "lora" / "pytorch_lora_weights.safetensors"))
    assert adapters and all(k.startswith("transformer.transformer_blocks.") and ".lora_" in k for k in adapters)
    merged = load_file(str(ltx_lora_run / "weights.safetensors"))
    cfg = load_config(ltx_lora_run)
    start = read_pretrained(str(pretrained_dir), cfg.model)
    changed = {k for k in start if not torch.equal(merged[k], start[k])}
    assert changed and all(".to_" in k or ".ff." in k for k in changed)  # only adapted layers moved

    ltx = LTXVideoTransformer3DModel.from_pretrained(str(pretrained_dir))
    ltx.load_lora_adapter(str(ltx_lora_run / "lora"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    assert same_outputs(cfg.model, merged, ltx) <= 1e-5
    pipe = LTXPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                       transformer=LTXVideoTransformer3DModel.from_pretrained(str(pretrained_dir)))
    pipe.load_lora_weights(str(ltx_lora_run / "lora"))
    assert same_outputs(cfg.model, merged, pipe.transformer) <= 1e-5
    base = LTXVideoTransformer3DModel.from_pretrained(str(pretrained_dir))
    assert same_outputs(cfg.model, merged, base) > 1e-3  # the adapters matter

    assert export_weights.main([str(ltx_lora_run), "--diffusers", str(tmp_path / "lora")]) == 0
    again = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    assert again.keys() == adapters.keys() and all(torch.equal(again[k], adapters[k]) for k in adapters)


def test_resuming_a_lora_run_as_another_family_is_refused(ltx_lora_run, data_cache, tmp_path):
    from dit_train.config.errors import ConfigError
    from tests.conftest import train_in_process

    ckpt = next((ltx_lora_run / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match="model.name: the checkpoint was trained with 'ltx', this run asks for 'wan'") as err:
        train_in_process(["+experiment=wan_lora", *(o for o in TINY if not o.startswith("optim")), "model.text_len=16",
                          "train.steps=3", "train.sample_every=0", "model.lora.rank=4", "model.lora.alpha=8",
                          f"train.resume={ckpt}"], tmp_path / "resumed", cache_dir=data_cache)
    assert str(err.value).count("\n  - ") == 1  # the family alone: its keys the other lacks follow from it
    assert not (tmp_path / "resumed" / "checkpoints").exists()


# --------------------------------------------------------------------------- layouts


@pytest.mark.slow
def test_layout_invariance_full_training(ltx_run_cfg):
    """Same weights after 2 clipped SGD steps for 1 process, Ulysses, ring, and FSDP2 × ring
    built on the meta device: uneven clips, packs split inside clips by CP, byte captions."""
    runs = run_layouts(ltx_run_cfg, ["1", "cp_ulysses=2", "dp_shard=2,cp_ring=2,meta_init=true"], ["sample_mean"])
    (oracle,) = runs.pop("1")
    for spec, (got,) in runs.items():
        rel = relative_difference(oracle, got)
        assert rel <= 1e-4, f"{spec}: weights differ by {rel:.2e} of the update"


@pytest.mark.slow
def test_layout_invariance_lora(ltx_run_cfg, pretrained_dir):
    """LoRA from a pretrained base: the adapters after 2 steps equal one process on FSDP2 with
    grad_accum and on Ulysses × FSDP2; the base stays where it was."""
    cfg = replace(ltx_run_cfg, model=replace(ltx_run_cfg.model, pretrained=str(pretrained_dir),
                                             lora=replace(ltx_run_cfg.model.lora, rank=4, alpha=8)))
    runs = run_layouts(cfg, ["1", "dp_shard=2,grad_accum=2", "dp_shard=2,cp_ulysses=2"], ["sample_mean"])
    (ref,) = runs.pop("1")
    assert any(".lora_" in k for k in ref)
    assert all(torch.equal(ref[k], ref[f"__init__/{k}"]) for k in ref if not k.startswith("__") and ".lora_" not in k)
    for spec, (got,) in runs.items():
        rel = relative_difference(ref, got)
        assert rel <= 1e-4, f"{spec}: adapters differ by {rel:.2e} of the update"


# --------------------------------------------------------------------------- latent cache


def test_latent_cache_with_ltx_vae_and_t5_then_train_and_sample(tmp_path):
    """tools.cache_latents with LTX-Video's VAE (per-channel statistics as buffers, 8x32x32) and
    a T5 encoder; ltx on the cache trains, validates and samples (prompts through the cache's T5)."""
    pytest.importorskip("transformers")
    from diffusers import AutoencoderKLLTXVideo
    from safetensors.torch import load_file
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    from dit_train.__main__ import run_from_config
    from dit_train.data_pipelines import latent_cache as lc
    from dit_train.tools import sample
    from dit_train.tools.cache_latents import main as cache_latents
    from tests.test_video_folder import make_video_folder

    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                                layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1), scaling_factor=2.0)
    vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]))
    vae.latents_std.copy_(torch.tensor([1.5, 0.5, 1.0, 2.0]))
    vae.save_pretrained(tmp_path / "ltx" / "vae")
    ByT5Tokenizer().save_pretrained(tmp_path / "ltx" / "tokenizer")
    T5EncoderModel(T5Config(vocab_size=384, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                            num_heads=2)).save_pretrained(tmp_path / "ltx" / "text_encoder")
    src = make_video_folder(tmp_path / "videos", tmp_path / "src", n=3)
    out = tmp_path / "latents"
    assert cache_latents(["--vae", str(tmp_path / "ltx"), "--text-encoder", str(tmp_path / "ltx"), "--max-text-len", "128",
                          "--out", str(out), "--no-progress", "model=ltx_tiny", "data=video_folder", f"data.root={src}",
                          f"data.cache_dir={tmp_path / 'c'}", "data.max_frames=9", "data.resolution_buckets=[[64,64]]"]) == 0
    meta = lc.read_cache_info(out)
    assert (meta["scale_factor_temporal"], meta["scale_factor_spatial"], meta["text_dim"]) == (8, 32, 16)
    assert meta["latents_mean"] == pytest.approx([0.1, -0.2, 0.0, 0.3])
    assert meta["latents_std"] == pytest.approx([0.75, 0.25, 0.5, 1.0])  # LTXPipeline: (z - mean) · scaling_factor / std
    row = json.loads((out / lc.MANIFEST).read_text().splitlines()[0])
    assert row["latent_shape"] == [4, 2, 2, 2] and row["text_len"] > 0

    cfg = compose_config([*(o for o in TINY if not o.startswith("data.")), "model=ltx_tiny", "data=latent_cache",
                          f"data.root={out}", "model.in_channels=4", "model.text_dim=16", "model.patch_size=[1,1,1]",
                          "train.steps=1", "train.global_batch=2", "train.sample_every=1", "train.sample_steps=2",
                          "train.num_samples=1"])
    cfg.run_dir = str(tmp_path / "run")
    assert run_from_config(cfg)["steps"] == 1
    gen = tmp_path / "gen"
    assert sample.main([str(tmp_path / "run"), "--prompt", "waves", "--frames", "9", "--height", "64", "--width", "64",
                        "--steps", "2", "--out", str(gen)]) == 0
    (x,) = load_file(gen / "samples.safetensors").values()
    assert x.shape == (3, 9, 64, 64)  # 9 frames -> 2 latent frames -> 1 + 8 decoded


def test_bench_families_quick_is_at_equal_parameters(tmp_path):
    from dit_train.tools.bench_families import main

    out = tmp_path / "f.json"
    assert main(["--quick", "--family", "ltx", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]["ltx"]
    assert res["params"]["ours"] == res["params"]["diffusers"]  # one module's weights, two forwards
    row = res["row"]
    assert row["ours_tok_s"] > 0 and row["padded_tok_s"] > 0 and row["padded_tokens"] > row["valid_tokens"]


def test_pipeline_shift_gives_ltx_pipelines_sigmas_per_clip_size():
    """model.pipeline_shift: our sampler's sigmas for each clip are the ones LTXPipeline uses for
    that size (shift e^mu from the latent frames x height x width, stretched to end at
    shift_terminal), read off the pipeline's scheduler after it sampled; two sizes, two
    schedules."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    from dit_train.config.schema import ParallelConfig
    from dit_train.models.diffusers_family import to_diffusers
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling import VideoSampler, pipeline_shift
    from dit_train.tasks.video_inputs import VideoInputs
    from dit_train.sampling.sampler import SampleRequest

    cfg = tiny_ltx_cfg(pipeline_shift=True, patch_size=[1, 1, 1])  # LTX-Video's patch
    # LTX-Video's scheduler/scheduler_config.json (the model.* defaults)
    config = dict(base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05, shift_terminal=0.1,
                  use_dynamic_shifting=True)
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**config), vae=None, text_encoder=None, tokenizer=None,
                       transformer=to_diffusers(random_model(cfg).state_dict(), cfg))
    shapes, steps = [(4, 2, 4, 6), (4, 2, 16, 40)], 5  # latents (C, F, H, W): 48 and 1280 positions
    ctx = torch.randn(1, 6, 24, generator=torch.Generator().manual_seed(0))
    theirs = []
    for _, f, h, w in shapes:
        pipe(prompt_embeds=ctx, prompt_attention_mask=torch.ones(1, 6), num_frames=8 * (f - 1) + 1, height=32 * h,
             width=32 * w, num_inference_steps=steps, guidance_scale=1.0, output_type="latent")
        theirs.append(pipe.scheduler.sigmas.clone())
    requests = [SampleRequest(f"p{k}", s, "", ctx[0], noise_id=k) for k, s in enumerate(shapes)]
    sampler = VideoSampler(requests, VideoInputs((1, 1, 1), text_dim=24), None, init_parallel(ParallelConfig(device="cpu")), steps, 1.0, 0,
                           shift=3.0, pipeline=pipeline_shift(cfg))
    ours = [s.sigmas for s in sampler.schedulers()]
    for mine, ref in zip(ours, theirs):
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)
        assert abs(float(mine[-2]) - 0.1) < 1e-6  # shift_terminal
    assert (theirs[0] - theirs[1]).abs().max() > 0.05  # the size sets the schedule
    fixed = VideoSampler(requests, VideoInputs((1, 1, 1), text_dim=24), None, sampler.ctx, steps, 1.0, 0, shift=3.0).schedulers()
    assert (fixed[1].sigmas - theirs[1]).abs().max() > 0.05  # not the run's loss.timestep_shift
