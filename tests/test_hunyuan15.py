"""diffusers' HunyuanVideo15Transformer3DModel (HunyuanVideo 1.5) through our packed path
(model.name=hunyuan15): joint text-video attention with the caption tokens as weight-0 slots.

1. The packed model (text slots from tasks/joint_text.py) equals diffusers' own forward run
   clip by clip: forward and every weight gradient, MLLM captions of uneven valid length, ByT5
   tokens, padding tokens.
2. Diffusers folders: a LoRA run's file loads with load_lora_adapter; a folder of another family
   or size is refused before the run, in one line (load, train, export, the sample tool with
   text slots: tests/test_diffusers_families.py).
3. Layout invariance, full training and LoRA, in one launch per world size: 1 process vs
   Ulysses, ring × FSDP2 (meta init), FSDP2 × grad_accum, Ulysses × FSDP2; uneven clips, packs
   and CP splits inside clips and inside their text.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dit_train.batch import WEIGHT_ONE
from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, model_config
from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from dit_train.tasks.joint_text import join_text_tokens
from dit_train.tasks.video import pack_clips, patchify
from tests.conftest import TINY, compose_config
from tests.families import family_run_cfg, PATCH, pretrained_folder, random_model, SHAPES



def tiny_cfg(**kw):
    base = dict(dim=32, heads=2, depth=2, text_dim=24, text_len=7, text_2_dim=20, image_dim=12, in_channels=4,
                image_cond_channels=5, refiner_depth=2, patch_size=list(PATCH), rope_axes=[4, 6, 6], init="normal")
    return model_config("hunyuan15", **(base | kw))


def diffusers_call(ref, clip, t, ctx, ctx_len, ctx2=None, ctx2_len=None, image_cond=5):
    """HunyuanVideo15Pipeline's text-to-video call on one clip [C, F, H, W]: the latents with
    zero conditioning channels, timestep 1000·t, padded captions with their masks, zero image
    embeddings; returns its output as our tokens [T, C·pt·ph·pw]."""
    x = torch.cat([clip, torch.zeros(image_cond, *clip.shape[1:])])[None]
    Lc = ctx.shape[1]
    ctx2 = torch.zeros(1, 1, ref.config.text_embed_2_dim) if ctx2 is None else ctx2
    ctx2_len = torch.zeros(1, dtype=torch.long) if ctx2_len is None else ctx2_len
    out = ref(x, t * 1000, ctx, (torch.arange(Lc) < ctx_len).long()[None], encoder_hidden_states_2=ctx2,
              encoder_attention_mask_2=(torch.arange(ctx2.shape[1]) < ctx2_len).long()[None],
              image_embeds=torch.zeros(1, 3, ref.config.image_embed_dim)).sample[0]
    return patchify(out, PATCH)[0]


def one_clip(model, clip, t, ctx, ctx_len):
    """Our packed forward of one clip followed by its caption's text slots: its video rows."""
    batch = join_text_tokens(pack_clips({"x": [clip]}, PATCH, clip.shape[0] * 4, {}, torch.zeros(1, dtype=torch.long)),
                             ctx_len)
    meta = VarlenLayout.build(batch.seg, batch.order, False)
    out = model(batch.tokens["x"], batch.pos, batch.seg, t, meta, ctx, ctx_len, text=batch.tokens["text"])
    return out[batch.tokens["text"] == 0]


def test_packed_forward_and_grads_match_diffusers_per_clip():
    cfg = tiny_cfg()
    ours = random_model(cfg)
    ref = to_diffusers(ours.state_dict(), cfg)  # diffusers' own module, same weights
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(4, *s, generator=g) for s in SHAPES]
    t = torch.tensor([0.3, 0.85])
    # MLLM captions of uneven valid length (garbage past it), ByT5 tokens on one clip only
    ctx, ctx_len = torch.randn(2, 7, 24, generator=g), torch.tensor([3, 7])
    ctx2, ctx2_len = torch.randn(2, 4, 20, generator=g), torch.tensor([2, 0])
    batch = pack_clips({"x": clips}, PATCH, 16, {}, torch.arange(2))
    batch = join_text_tokens(batch, ctx_len + ctx2_len).pad_to_multiple(8)  # padding tokens too
    assert int((batch.tokens["text"] > 0).sum()) == 3 + 2 + 7  # each clip's valid [ByT5 | MLLM] tokens
    assert int(batch.weight_units()[batch.tokens["text"] > 0].sum()) == 0  # text slots weigh nothing
    meta = VarlenLayout.build(batch.seg, batch.order, causal=False)
    assert meta.cu_seqlens is not None  # each clip with its text is one contiguous run
    out = ours(batch.tokens["x"], batch.pos, batch.seg, t, meta, ctx, ctx_len, text=batch.tokens["text"],
               context_2=ctx2, context_2_len=ctx2_len)
    assert torch.equal(out[batch.tokens["text"] > 0], torch.zeros_like(out[batch.tokens["text"] > 0]))

    loss_ours, loss_ref = 0.0, 0.0
    for i, clip in enumerate(clips):
        mine = out[(batch.seg == i) & (batch.tokens["text"] == 0)]
        theirs = diffusers_call(ref, clip, t[i:i + 1], ctx[i:i + 1], ctx_len[i], ctx2[i:i + 1], ctx2_len[i])
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        probe = torch.randn(theirs.shape, generator=g)
        loss_ours = loss_ours + (mine * probe).sum()
        loss_ref = loss_ref + (theirs * probe).sum()
    pad = batch.seg < 0
    assert pad.any() and out[pad].abs().max() < 1e3  # padding tokens: finite, ignored

    loss_ours.backward()
    loss_ref.backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        gr = ref_grads[name].grad
        if name.startswith("image_embedder."):  # text-to-video: diffusers multiplies the image tokens by 0
            assert p.grad is None and not gr.abs().max(), name
            continue
        # the last block's text-stream output reaches nothing: diffusers leaves no gradient, ours is 0
        if ".1.attn.to_add_out." in name or ".1.ff_context." in name:
            assert gr is None and not p.grad.abs().max(), name
            continue
        p = p.grad[:2] if name == "cond_type_embed.weight" else p.grad  # row 2 (image tokens): zero in both
        gr = gr[:2] if name == "cond_type_embed.weight" else gr
        assert p is not None and gr is not None, name
        # floor 1e-2: the key biases' gradients are 0 in exact arithmetic (softmax ignores a
        # shift of every score), ~1e-7 rounding in both
        assert (p - gr).abs().max() <= 1e-4 * gr.abs().max().clamp_min(1e-2), name


def test_text_slots_are_outside_the_clip_counts_and_rope_follows_positions():
    """join_text_tokens keeps the video tokens' order, weights and positions, adds weight-0
    slots after each clip; the model's output depends on each video token's own position."""
    clips = [torch.randn(4, *s) for s in SHAPES]
    plain = pack_clips({"x": clips}, PATCH, 16, {}, torch.arange(2),
                       weights=[torch.full((12,), WEIGHT_ONE), torch.full((6,), WEIGHT_ONE // 2)])
    joined = join_text_tokens(plain, torch.tensor([3, 0]))
    assert joined.seg.tolist() == [0] * 15 + [1] * 6 and joined.order[12:15].tolist() == [12, 13, 14]
    video = joined.tokens["text"] == 0
    assert torch.equal(joined.tokens["x"][video], plain.tokens["x"]) and torch.equal(joined.pos[video], plain.pos)
    assert torch.equal(joined.local_weights(), plain.local_weights())  # T_b of every clip unchanged
    cfg = tiny_cfg()
    model = random_model(cfg)
    ctx = torch.randn(1, 7, 24)
    a = one_clip(model, clips[0], torch.tensor([0.5]), ctx, torch.tensor([4]))
    b = one_clip(model, clips[0], torch.tensor([0.5]), ctx, torch.tensor([5]))
    assert (a - b).abs().max() > 1e-4  # the clip attends to its caption's valid tokens (one more here)
    tok, grid = patchify(clips[0], PATCH)
    seg = torch.zeros(12, dtype=torch.long)
    meta = VarlenLayout.build(seg, torch.arange(12), False)
    c = model(tok, grid, seg, torch.tensor([0.5]), meta)
    assert (c - model(tok, grid.flip(0), seg, torch.tensor([0.5]), meta)).abs().max() > 1e-3


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_keeps_outputs_and_gradients(policy):
    """Checkpointed blocks (the spec's transformer_blocks) recompute exactly what was run,
    text slots included."""
    from dit_train.models import model_spec
    from dit_train.parallel.checkpointing import apply_activation_checkpointing

    cfg = tiny_cfg()
    plain, ckpt = random_model(cfg), random_model(cfg)
    apply_activation_checkpointing(model_spec(cfg).blocks(ckpt), policy)
    clip, ctx = torch.randn(4, *SHAPES[0], generator=torch.Generator().manual_seed(4)), torch.randn(1, 7, 24)
    outs = [one_clip(m, clip, torch.tensor([0.6]), ctx, torch.tensor([5])) for m in (plain, ckpt)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for out in outs:
        out.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


# --------------------------------------------------------------------------- folders, bad input


def test_pretrained_of_another_family_or_size_is_refused_before_the_run(tmp_path):
    """One line naming what does not fit, from check_config (config.json only, before step 0)."""
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from dit_train.models.diffusers_family import to_diffusers as ltx_to_diffusers

    cfg = tiny_cfg()
    to_diffusers(random_model(cfg).state_dict(), cfg).save_pretrained(str(tmp_path / "hy" / "transformer"))
    assert read_pretrained(str(tmp_path / "hy"), cfg).keys() == random_model(cfg).state_dict().keys()
    with pytest.raises(ValueError, match=r"num_layers=2 \(model.depth gives 3\)"):
        read_pretrained(str(tmp_path / "hy"), tiny_cfg(depth=3))
    ltx_cfg = model_config("ltx", dim=32, heads=2, depth=1, text_dim=24, in_channels=4, patch_size=list(PATCH))
    ltx_to_diffusers(build_model(ltx_cfg).state_dict(), ltx_cfg).save_pretrained(str(tmp_path / "ltx"))
    base = ["model=hunyuan15_tiny", "model.dim=32", "model.heads=2", "model.rope_axes=[4,6,6]", "model.text_dim=24",
            "model.text_2_dim=20", "model.image_dim=12", "model.in_channels=4", "model.patch_size=[1,2,2]",
            "model.refiner_depth=2"]
    for folder, extra, want in (
            ("ltx", [], "holds a LTXVideoTransformer3DModel, not a HunyuanVideo15Transformer3DModel"),
            ("hy", [], r"in_channels=9 \(model.in_channels \+ image_cond_channels gives 4\)"),
            ("hy", ["model.image_cond_channels=5", "model.refiner_depth=1"], r"num_refiner_layers=2 \(model.refiner_depth gives 1\)")):
        run = compose_config([*base, *extra, f"model.pretrained={tmp_path / folder}"])
        with pytest.raises(ConfigError, match=want) as err:
            check_config(run)
        assert "\n" not in str(err.value)


def test_exported_model_runs_in_hunyuan_video15_pipeline(tmp_path):
    """A saved folder of our model (image_cond_channels = in_channels + 1, as the pipeline
    concatenates [latents | conditioning latents | mask]) loads into HunyuanVideo15Pipeline
    with a tiny VAE and samples with CFG and the scheduler's shift (embeddings given)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)

    cfg = tiny_cfg(patch_size=[1, 1, 1])
    to_diffusers(random_model(cfg).state_dict(), cfg).save_pretrained(str(tmp_path / "transformer"))
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1)
    pipe = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, vae=vae, text_encoder_2=None, tokenizer_2=None,
                                  transformer=HunyuanVideo15Transformer3DModel.from_pretrained(str(tmp_path / "transformer")),
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                                  guider=ClassifierFreeGuidance(guidance_scale=3.0))
    g = torch.Generator().manual_seed(1)
    mask, byt5, none = torch.ones(1, 7, dtype=torch.long), torch.zeros(1, 4, 20), torch.zeros(1, 4, dtype=torch.long)
    out = pipe(prompt_embeds=torch.randn(1, 7, 24, generator=g), prompt_embeds_mask=mask,
               negative_prompt_embeds=torch.randn(1, 7, 24, generator=g), negative_prompt_embeds_mask=mask,
               prompt_embeds_2=byt5, prompt_embeds_mask_2=none, negative_prompt_embeds_2=byt5,
               negative_prompt_embeds_mask_2=none, height=32, width=32, num_frames=5, num_inference_steps=2,
               output_type="pt", generator=g).frames
    assert out.shape == (1, 5, 3, 32, 32) and bool(torch.isfinite(out).all())


@pytest.fixture(scope="module")
def hy_run_cfg(data_cache):
    return family_run_cfg(["model=hunyuan15_tiny", "model.rope_axes=[2,2,4]", "model.text_len=32"], data_cache)


def test_step_plan_counts_each_samples_text_slots(hy_run_cfg):
    """A sample's length in the step plan bounds its pack tokens, text slots included, so packs
    stay within train.micro_batch_tokens."""
    from dit_train.tasks import build_task

    c = hy_run_cfg
    task = build_task(c.mode, c.data, c.model, c.loss, c.train.seed, cond=c.cond)
    video = task.dataset.lengths()
    assert task.lengths() == [n + c.model.text_len for n in video]
    for i in range(4):
        batch = task.build([i], step=0)
        assert video[i] < batch.num_tokens <= task.lengths()[i]


@pytest.fixture(scope="module")
def pretrained_dir(hy_run_cfg, tmp_path_factory):
    """A diffusers folder with random weights of the run's shape (nothing downloaded)."""
    return pretrained_folder(hy_run_cfg.model, tmp_path_factory.mktemp("hy_pretrained"))


def same_outputs(cfg, weights, diffusers_model):
    """Our packed model with `weights` vs `diffusers_model` on one 2x16x24 pixel clip with a
    5-token caption of 8 slots: max |diff| / max."""
    ours = build_model(replace(cfg, lora=replace(cfg.lora, rank=0)))
    ours.load_state_dict(weights)
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(3, 2, 16, 24, generator=g)
    ctx, n = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g), torch.tensor([5])
    batch = join_text_tokens(pack_clips({"x": [clip]}, tuple(cfg.patch_size), 3 * 128, {}, torch.zeros(1, dtype=torch.long)), n)
    meta = VarlenLayout.build(batch.seg, batch.order, False)
    with torch.no_grad():
        mine = ours(batch.tokens["x"], batch.pos, batch.seg, torch.tensor([0.4]), meta, ctx, n, text=batch.tokens["text"])
        mine = mine[batch.tokens["text"] == 0]
        x = clip[None]
        theirs = diffusers_model(x, torch.tensor([400.0]), ctx, (torch.arange(cfg.text_len) < n).long()[None],
                                 encoder_hidden_states_2=torch.zeros(1, 1, cfg.text_2_dim),
                                 encoder_attention_mask_2=torch.zeros(1, 1, dtype=torch.long),
                                 image_embeds=torch.zeros(1, 2, cfg.image_dim)).sample[0]
    theirs = patchify(theirs, tuple(cfg.patch_size))[0]
    return float((mine - theirs).abs().max() / theirs.abs().max())


@pytest.fixture(scope="module")
def hy_lora_cfg(hy_run_cfg, pretrained_dir):
    return replace(hy_run_cfg, model=replace(hy_run_cfg.model, pretrained=str(pretrained_dir),
                                             lora=replace(hy_run_cfg.model.lora, rank=4, alpha=8)))


def test_lora_run_loads_in_diffusers_with_matching_outputs(hy_lora_cfg, pretrained_dir, tmp_path):
    """The run's diffusers LoRA file on HunyuanVideo15Transformer3DModel (load_lora_adapter)
    gives our packed model's outputs with the run's merged weights (<= 1e-5); only the blocks'
    two streams moved (the token refiner stays frozen)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from safetensors.torch import load_file

    from dit_train.engine.worker import train as run

    cfg = replace(hy_lora_cfg, train=replace(hy_lora_cfg.train, steps=2, ckpt_every=2),
                  optim=replace(hy_lora_cfg.optim, lr=0.05, max_grad_norm=0.0), run_dir=str(tmp_path / "run"))
    run(cfg)
    adapters = load_file(str(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"))
    assert adapters and all(k.startswith("transformer.transformer_blocks.") and ".lora_" in k for k in adapters)
    assert any(".add_q_proj." in k for k in adapters) and any(".ff_context." in k for k in adapters)
    merged = load_file(str(tmp_path / "run" / "weights.safetensors"))
    start = read_pretrained(str(pretrained_dir), cfg.model)
    changed = {k for k in start if not torch.equal(merged[k], start[k])}
    assert changed and all(k.startswith("transformer_blocks.") for k in changed)

    hy = HunyuanVideo15Transformer3DModel.from_pretrained(str(pretrained_dir))
    hy.load_lora_adapter(str(tmp_path / "run" / "lora"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    assert same_outputs(cfg.model, merged, hy) <= 1e-5
    base = HunyuanVideo15Transformer3DModel.from_pretrained(str(pretrained_dir))
    assert same_outputs(cfg.model, merged, base) > 1e-3  # the adapters matter


# --------------------------------------------------------------------------- layouts


@pytest.mark.slow
def test_layout_invariance_full_training_and_lora(hy_run_cfg, hy_lora_cfg):
    """Same weights after 2 clipped SGD steps as one process, full training (Ulysses; FSDP2 ×
    ring built on the meta device) and LoRA from a pretrained base (FSDP2 with grad_accum;
    Ulysses × FSDP2), all in one launch of 4 workers: uneven clips, packs and CP splits inside
    clips and their text slots, byte captions of uneven length."""
    from dit_train.engine.layout_equivalence import apply_layout, parse_layout, relative_difference, train_on_workers

    full = ["1", "cp_ulysses=2", "dp_shard=2,cp_ring=2,meta_init=true"]
    lora = ["1", "dp_shard=2,grad_accum=2", "dp_shard=2,cp_ulysses=2"]
    jobs = [(hy_run_cfg, s) for s in full] + [(hy_lora_cfg, s) for s in lora]
    results = train_on_workers([apply_layout(c, parse_layout(s), "sample_mean") for c, s in jobs])
    # 1e-5, not the 1e-4 of the other families: these layouts agree to 1.4e-6, while a rank
    # reading a CP-split caption's slots by local position (a bug tried once) moved them 4.4e-5
    for oracle, others, specs in ((results[0], results[1:3], full[1:]), (results[3], results[4:], lora[1:])):
        for spec, got in zip(specs, others):
            rel = relative_difference(oracle, got)
            assert rel <= 1e-5, f"{spec}: weights differ by {rel:.2e} of the update"
    ref = results[3]
    assert any(".lora_" in k for k in ref)
    assert all(torch.equal(ref[k], ref[f"__init__/{k}"]) for k in ref if not k.startswith("__") and ".lora_" not in k)


# --------------------------------------------------------------------------- latent cache


def tiny_mllm(folder) -> None:
    """A Qwen2.5-VL text model (random, 3 layers) and a byte-level tokenizer with a chat template,
    saved as HunyuanVideo 1.5's text_encoder/ and tokenizer/ (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", chat_template=template,
                            additional_special_tokens=["<|im_start|>", "<|im_end|>"]).save_pretrained(folder / "tokenizer")
    torch.manual_seed(0)
    config = Qwen2_5_VLTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                  num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                                      "rope_theta": 10000.0})
    Qwen2_5_VLTextModel(config).save_pretrained(folder / "text_encoder")


def test_latent_cache_with_hunyuan15_vae_and_mllm_then_train(tmp_path):
    """tools.cache_latents with HunyuanVideo 1.5's VAE (16x spatial, 4x temporal, one scaling
    factor) and its MLLM read as the pipeline does (chat template, third-to-last layer, crop);
    hunyuan15 trains on the cache with the cached captions as text slots."""
    pytest.importorskip("transformers")
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline
    from transformers import AutoTokenizer, Qwen2_5_VLTextModel

    from dit_train.__main__ import run_from_config
    from dit_train.data_pipelines import latent_cache as lc
    from dit_train.tools.cache_latents import main as cache_latents
    from tests.test_video_folder import make_video_folder

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                scaling_factor=2.0).save_pretrained(tmp_path / "hy" / "vae")
    tiny_mllm(tmp_path / "hy")
    src = make_video_folder(tmp_path / "videos", tmp_path / "src", n=3)
    out = tmp_path / "latents"
    assert cache_latents(["--vae", str(tmp_path / "hy"), "--text-encoder", str(tmp_path / "hy"), "--max-text-len", "24",
                          "--out", str(out), "--no-progress", "model=hunyuan15_tiny", "data=video_folder", f"data.root={src}",
                          f"data.cache_dir={tmp_path / 'c'}", "data.max_frames=5", "data.resolution_buckets=[[32,32]]"]) == 0
    meta = lc.read_cache_info(out)
    assert (meta["scale_factor_temporal"], meta["scale_factor_spatial"], meta["text_dim"]) == (4, 16, 16)
    assert meta["latents_std"] == pytest.approx([0.5] * 4)  # HunyuanVideo15Pipeline: z · scaling_factor
    # the cached caption is the pipeline's own prompt embedding, valid tokens only
    ds = lc.LatentCacheDataset(out, (1, 1, 1))
    item = ds[0]
    model = Qwen2_5_VLTextModel.from_pretrained(str(tmp_path / "hy" / "text_encoder"))
    emb, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(model, AutoTokenizer.from_pretrained(str(tmp_path / "hy" / "tokenizer")),
                                                               item.caption, "cpu", tokenizer_max_length=24)
    torch.testing.assert_close(item.text_emb.float(), emb[0][mask[0].bool()], rtol=1e-5, atol=1e-5)

    cfg = compose_config([*(o for o in TINY if not o.startswith("data.")), "model=hunyuan15_tiny", "data=latent_cache",
                          f"data.root={out}", "model.in_channels=4", "model.text_dim=16", "model.text_len=24",
                          "model.patch_size=[1,1,1]", "model.rope_axes=[2,2,4]", "train.steps=1", "train.global_batch=2"])
    cfg.run_dir = str(tmp_path / "run")
    assert run_from_config(cfg)["steps"] == 1
