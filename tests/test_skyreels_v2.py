"""diffusers' SkyReelsV2Transformer3DModel through our packed path (model.name=skyreels_v2).

1. The packed model equals diffusers' own forward run clip by clip (forward and every weight
   gradient) with per-frame timesteps (`enable_diffusion_forcing=True`), diffusers' block-causal
   mask (`num_frame_per_block`) against ours from the pack's block keys, the fps embedding, uneven
   clips and padding; and with one timestep per clip, bidirectional.
2. A folder of another family or size is refused before any worker starts; a one-patch causal
   block (which diffusers would export bidirectional) is refused in one line.
3. Layout-exact diffusion-forcing training (1 process vs dp x Ulysses / ring) on uneven clips.
(The pretrained -> train -> export round trip: tests/test_diffusers_families.py; exact resume
and tools.sample: tests/test_families.py.)
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, model_config
from dit_train.models.diffusers_family import to_diffusers
from dit_train.tasks.video import patchify
from tests.conftest import compose_config
from tests.families import random_model, assert_matches_diffusers_per_clip

PATCH = (1, 2, 2)
SHAPES = [(4, 4, 6), (6, 2, 4)]  # (F, H, W): 2 and 3 causal blocks of 2 frames


def tiny_cfg(**kw):
    base = dict(dim=32, heads=2, depth=2, ffn_dim=64, freq_dim=32, text_dim=32, text_len=6, in_channels=4,
                patch_size=list(PATCH), init="normal", causal_block_frames=2, inject_sample_info=True)
    return model_config("skyreels_v2", **(base | kw))


def pack(clips: list[torch.Tensor], K: int, pad: int = 0):
    """Packed inputs of `clips` ([C, F, H, W] each) and `pad` padding tokens: tokens, positions,
    clips, each token's causal block (frames // K; 0 when K = 0) and the attention layout whose
    mask key is the block (block-causal) or the in-clip index (bidirectional: causal=False)."""
    toks, pos, seg = [], [], []
    for i, x in enumerate(clips):
        tk, grid = patchify(x, PATCH)
        toks.append(tk), pos.append(grid), seg.append(torch.full((tk.shape[0],), i))
    toks.append(torch.zeros(pad, toks[0].shape[1])), pos.append(torch.zeros(pad, 3, dtype=torch.long))
    seg.append(torch.full((pad,), -1))
    seg, pos = torch.cat(seg), torch.cat(pos)
    block = pos[:, 0] // K if K else torch.zeros_like(seg)
    order = torch.cat([torch.arange(len(s)) for s in torch.split(seg, [t.shape[0] for t in toks])])
    meta = VarlenLayout.build(seg, block if K else order, causal=bool(K))
    return torch.cat(toks), pos, seg, block, meta


@pytest.mark.parametrize("per_block", [True, False], ids=["block_causal_per_block_t", "bidirectional_per_clip_t"])
def test_packed_forward_and_grads_match_diffusers_per_clip(per_block):
    K = 2 if per_block else 0
    cfg = tiny_cfg(causal_block_frames=K, attend_padded_context=False)
    ours = random_model(cfg)
    ref = to_diffusers(ours.state_dict(), cfg)
    assert ref.config.num_frame_per_block == (2 if per_block else 1) and ref.config.inject_sample_info
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(4, *s, generator=g) for s in SHAPES]
    # per block: [S, B] levels, B = the most blocks of a clip (clip 0 has 2, its third is unused)
    t = torch.tensor([[0.3, 0.7, 0.0], [0.9, 0.1, 0.5]]) if per_block else torch.tensor([0.3, 0.85])
    context, context_len = torch.randn(2, 5, 32, generator=g), torch.tensor([3, 5])
    x, pos, seg, block, meta = pack(clips, K, pad=3)
    out = ours(x, pos, seg, t, meta, context, context_len, block=block if per_block else None)

    def theirs(i, clip, grid):
        ctx = context[i:i + 1, :context_len[i]]
        if per_block:  # diffusers: one timestep per latent frame, the frame's block's
            frame_t = t[i, torch.arange(grid[0]) // K][None] * 1000
            return ref(clip[None], frame_t, ctx, enable_diffusion_forcing=True, fps=[1]).sample[0]
        return ref(clip[None], t[i:i + 1] * 1000, ctx, fps=[1]).sample[0]

    assert_matches_diffusers_per_clip(ours, ref, out, clips, theirs, 4, g)


def test_later_blocks_do_not_reach_earlier_ones():
    """Block-causal through the packed model: moving block 1's input or t changes blocks >= 1 of
    that clip only."""
    cfg = tiny_cfg()
    ours = random_model(cfg)
    g = torch.Generator().manual_seed(1)
    clips = [torch.randn(4, *s, generator=g) for s in SHAPES]
    x, pos, seg, block, meta = pack(clips, 2)
    t = torch.tensor([[0.3, 0.7, 0.0], [0.9, 0.1, 0.5]])
    with torch.no_grad():
        a = ours(x, pos, seg, t, meta, block=block)
        x2 = x.clone()
        x2[(seg == 1) & (block == 1)] += 1.0
        b = ours(x2, pos, seg, t, meta, block=block)
        t2 = t.clone()
        t2[1, 1] = 0.6
        c = ours(x, pos, seg, t2, meta, block=block)
    for moved in (b, c):
        changed = (moved - a).abs().amax(-1) > 1e-6
        assert bool(changed[(seg == 1) & (block >= 1)].all())
        assert not bool(changed[(seg == 0) | ((seg == 1) & (block == 0))].any())


def test_one_patch_blocks_and_other_folders_are_refused_in_one_line(tmp_path):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    run = compose_config(["model=skyreels_v2_tiny", "model.text_len=16", "model.causal_block_frames=2"])
    with pytest.raises(ConfigError, match=r"model.causal_block_frames=2 must be 0 .* at least 2 temporal patches"):
        check_config(run)
    run = compose_config(["model=skyreels_v2_tiny", "model.text_len=16"])
    bigger = replace(run.model, depth=run.model.depth + 1)
    to_diffusers(build_model(bigger).state_dict(), bigger).save_pretrained(str(tmp_path / "sky" / "transformer"))
    wan = model_config("wan", **{k: getattr(run.model, k) for k in ("dim", "heads", "depth", "ffn_dim", "freq_dim",
                                                                     "text_dim", "in_channels", "patch_size")})
    to_diffusers(build_model(wan).state_dict(), wan).save_pretrained(str(tmp_path / "wan"))
    plain = replace(run.model, inject_sample_info=False)
    to_diffusers(build_model(plain).state_dict(), plain).save_pretrained(str(tmp_path / "plain"))
    for folder, want in (("sky", fr"num_layers={bigger.depth} \(model.depth gives {run.model.depth}\)"),
                         ("wan", "holds a WanTransformer3DModel, not a SkyReelsV2Transformer3DModel"),
                         ("plain", r"inject_sample_info=False \(model.inject_sample_info gives True\)")):
        run.model.pretrained = str(tmp_path / folder)
        with pytest.raises(ConfigError, match=want) as err:
            check_config(run)
        assert "\n" not in str(err.value)


def same_outputs(cfg, weights, sky) -> float:
    """Our packed model with `weights` vs diffusers' `sky` on one 8x16x24 pixel clip of two causal
    blocks at different t (per-frame timesteps, diffusers' block-causal mask), no caption (Wan's
    zeros up to text_len), fps 24: max |diff| / max."""
    ours = build_model(replace(cfg, lora=replace(cfg.lora, rank=0)))
    ours.load_state_dict(weights)
    clip = torch.randn(3, 8, 16, 24, generator=torch.Generator().manual_seed(5))
    patch = tuple(cfg.patch_size)
    tok, grid = patchify(clip, patch)
    per_block = cfg.causal_block_frames // patch[0]
    block = grid[:, 0] // per_block
    seg = torch.zeros(tok.shape[0], dtype=torch.long)
    t = torch.tensor([[0.4, 0.8]])
    frame_t = t[0, torch.arange(8 // patch[0]) // per_block][None] * 1000
    with torch.no_grad():
        mine = ours(tok, grid, seg, t, VarlenLayout.build(seg, block, True), block=block)
        theirs = sky(clip[None], frame_t, torch.zeros(1, cfg.text_len, cfg.text_dim), enable_diffusion_forcing=True,
                     fps=[0 if cfg.fps == 16 else 1]).sample[0]
    theirs = patchify(theirs, patch)[0]
    return float((mine - theirs).abs().max() / theirs.abs().max())


# --------------------------------------------------------------------------- training runs

DF = ["model=skyreels_v2_tiny", "model.text_len=16", "loss.frame_noise=block", "loss.history_prob=0.5",
      "loss.block_noise_schedule=nondecreasing"]


@pytest.fixture(scope="module")
def df_run_cfg(data_cache):
    from tests.families import family_run_cfg

    return family_run_cfg(DF, data_cache)


@pytest.fixture(scope="module")
def pretrained_dir(df_run_cfg, tmp_path_factory):
    from tests.families import pretrained_folder

    return pretrained_folder(df_run_cfg.model, tmp_path_factory.mktemp("skyreels_pretrained"))


def test_lora_run_loads_in_diffusers_with_matching_outputs(data_cache, pretrained_dir, tmp_path):
    """A diffusion-forcing LoRA run from a pretrained folder writes diffusers' LoRA file: diffusers'
    SkyReelsV2Transformer3DModel with the pretrained weights + load_lora_adapter gives the outputs of
    our packed model with the run's merged weights (two blocks at different t, causal mask, fps)."""
    from diffusers import SkyReelsV2Transformer3DModel
    from safetensors.torch import load_file

    from dit_train.models.diffusers_family import read_pretrained
    from tests.conftest import TINY, train_in_process

    tiny = [o for o in TINY if not o.startswith("optim")]
    run = tmp_path / "run"
    train_in_process([DF[0], *tiny, *DF[1:], "optim=adamw", "optim.lr=3e-3", "train.steps=2", "model.lora.rank=4",
                      "model.lora.alpha=8", f"model.pretrained={pretrained_dir}"], run, cache_dir=data_cache)
    adapters = load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))
    assert adapters and all(k.startswith("transformer.blocks.") and ".lora_" in k for k in adapters)
    merged = load_file(str(run / "weights.safetensors"))
    cfg = compose_config([DF[0], *tiny, *DF[1:]])
    start = read_pretrained(str(pretrained_dir), cfg.model)
    changed = {k for k in start if not torch.equal(merged[k], start[k])}
    assert changed and all(".to_" in k or ".ffn." in k for k in changed)  # only adapted layers moved
    sky = SkyReelsV2Transformer3DModel.from_pretrained(str(pretrained_dir))
    sky.load_lora_adapter(str(run / "lora"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    assert same_outputs(cfg.model, merged, sky) <= 1e-5
    assert same_outputs(cfg.model, start, SkyReelsV2Transformer3DModel.from_pretrained(str(pretrained_dir))) <= 1e-5


# The one-process oracle vs DP x ring, Ulysses and Ulysses x ring on the uneven embedded clips (1 or 2
# causal blocks of 4 frames), per-block t sorted along time and clean history blocks: full training
# from seeded init, and LoRA from a pretrained base.
LAYOUTS = ["dp_shard=2,cp_ring=2", "cp_ulysses=2", "cp_ulysses=2,cp_ring=2"]


@pytest.fixture(scope="module")
def layouts(df_run_cfg, tmp_path_factory):
    from dit_train.engine.layout_equivalence import apply_layout
    from tests.families import pretrained_folder
    from tests.layout_cases import Case, run_cases

    full = apply_layout(df_run_cfg, {})
    full.train.steps = 2
    # one block (and a pretrained base of one): the runs are Python-bound (a step costs its blocks'
    # calls, not their width), and the causal blocks split over CP, the counts, the shards and the
    # adapters on the base need no second transformer block
    full.model.depth = 1
    base = pretrained_folder(full.model, tmp_path_factory.mktemp("skyreels_pretrained_one_block"))
    lora = apply_layout(full, {})
    lora.model.pretrained, lora.model.lora.rank, lora.model.lora.alpha = str(base), 4, 8.0
    clip = apply_layout(full, {})  # per-clip noise: shows the per-block runs are not vacuous
    clip.loss.frame_noise, clip.loss.history_prob, clip.loss.block_noise_schedule = "clip", 0.0, "independent"
    cases = {("full", spec): Case(full, spec, "sample_mean") for spec in LAYOUTS}
    cases |= {("lora", spec): Case(lora, spec, "token_mean") for spec in LAYOUTS}
    cases[("clip", "cp_ulysses=2")] = Case(clip, "cp_ulysses=2", "sample_mean")
    return run_cases(cases)


@pytest.mark.slow
@pytest.mark.parametrize("spec", LAYOUTS)
def test_diffusion_forcing_layout_matches_one_process(spec, layouts):
    from dit_train.engine.layout_equivalence import relative_difference
    from tests.layout_cases import assert_exact, TOL

    per_block, per_clip = layouts[("full", LAYOUTS[0])][0], layouts[("clip", "cp_ulysses=2")][0]
    assert relative_difference(per_block, per_clip) > TOL, "per-block noise should train differently"
    for kind in ("full", "lora"):
        oracle, got = layouts[(kind, spec)]
        assert_exact(oracle, got, f"skyreels_v2 {kind} {spec}")


def test_an_exported_run_samples_in_the_diffusion_forcing_pipeline(models, data_cache, tmp_path):
    """`export_weights RUN --diffusers` of a diffusion-forcing run (full weights; and a LoRA run's
    base plus its adapter file through `load_lora_weights`) runs diffusers'
    SkyReelsV2DiffusionForcingPipeline for a few steps, synchronous and asynchronous (ar_step 1),
    with the run's causal block. The tiny Wan VAE only sets the pipeline's scale factors (latent
    output); the captions are given as prompt_embeds (the run's text_dim)."""
    from diffusers import AutoencoderKLWan, SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel
    from diffusers import UniPCMultistepScheduler

    from dit_train.tools.export_weights import main as export
    from tests.conftest import TINY, train_in_process

    # diffusers' pipeline counts causal_block_size in latent frames = num_frame_per_block: patch t 1
    base = [DF[0], *TINY, *DF[1:], "model.patch_size=[1,2,2]", "model.causal_block_frames=2", "train.steps=1",
            "train.sample_every=0", "train.micro_batch_tokens=0", "train.global_batch=2", "data.widths=[32]",
            "data.heights=[32]", "data.max_frames=4"]  # 2 clips of <= 1024 tokens: patch [1, 2, 2] is fine-grained
    transformers = {}
    train_in_process(base, tmp_path / "full", cache_dir=data_cache)
    assert export([str(tmp_path / "full"), "--diffusers", str(tmp_path / "full_dif")]) == 0
    transformers["full"] = (tmp_path / "full_dif", None)
    train_in_process([*base, "model.lora.rank=2", "model.init=normal"], tmp_path / "lora", cache_dir=data_cache)
    assert export([str(tmp_path / "lora"), "--base", "--diffusers", str(tmp_path / "lora_base")]) == 0
    assert export([str(tmp_path / "lora"), "--diffusers", str(tmp_path / "lora_dif")]) == 0
    transformers["lora"] = (tmp_path / "lora_base", tmp_path / "lora_dif")
    vae = AutoencoderKLWan.from_pretrained(str(models / "vae"))
    emb = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0))
    outs = {}
    for name, (folder, lora) in transformers.items():
        transformer = SkyReelsV2Transformer3DModel.from_pretrained(str(folder))
        assert transformer.config.num_frame_per_block == 2 and transformer.config.inject_sample_info
        pipe = SkyReelsV2DiffusionForcingPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae,
                                                  scheduler=UniPCMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True,
                                                                                   prediction_type="flow_prediction"))
        if lora is not None:
            pipe.load_lora_weights(str(lora))
            assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
        for ar_step in (0, 1):
            with torch.no_grad():
                out = pipe(prompt=None, prompt_embeds=emb, height=16, width=16, num_frames=13, num_inference_steps=2,
                           guidance_scale=1.0, ar_step=ar_step, causal_block_size=2, output_type="latent",
                           generator=torch.Generator().manual_seed(0)).frames
            assert out.shape == (1, 3, 4, 2, 2) and bool(torch.isfinite(out).all()), (name, ar_step)
            outs[(name, ar_step)] = out
    assert (outs[("full", 0)] - outs[("lora", 0)]).abs().max() > 1e-4  # two different transformers
