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

import re
import shutil

import pytest
import torch

from dit_train.models import model_config
from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from dit_train.tasks.conditioning import vace_context
from dit_train.tasks.video import patchify, unpatchify
from tests.families import PATCH, SHAPES, random_model, assert_matches_diffusers_per_clip
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
    assert any(n.startswith("vace_blocks.") for n, _ in ref.named_parameters())

    def theirs(i, clip, grid):
        ctx = torch.nn.functional.pad(context[i:i + 1, :context_len[i]], (0, 0, 0, cfg.text_len - int(context_len[i])))
        return ref(clip[None], t[i:i + 1] * 1000, ctx, control_hidden_states=ctrls[i][None]).sample[0]

    assert_matches_diffusers_per_clip(ours, ref, out, clips, theirs, C, g)


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


@pytest.fixture(scope="module")
def control_folder(tmp_path_factory):
    """3 uneven clips with clip.control.mp4 beside each (the shape's silhouette)."""
    from dit_train.data_pipelines.example_videos import ExampleClip, write_example_videos

    root = tmp_path_factory.mktemp("vace_videos")
    write_example_videos(root, [ExampleClip(f"clip_{i}.mp4", h, w, 8, f, c, s, "navy")
                                for i, (h, w, f, c, s) in enumerate([(32, 32, 4, "red", "circle"),
                                                                     (32, 48, 2, "green", "square"),
                                                                     (48, 32, 4, "blue", "circle")])], control=True)
    return root


def folder_cfg(root, cache, extra: list[str] = ()):
    from tests.conftest import TINY_MODEL, compose_config

    return compose_config([*TINY_MODEL, "model=wan_vace_tiny", "model.dim=32", "model.heads=2", "model.text_len=16",
                           "model.patch_size=[2,16,16]", "data=video_folder", f"data.root={root}", "data.num_workers=0",
                           "data.resolution_buckets=null", "data.max_frames=4", "cond.control=true", "train.global_batch=3",
                           "train.micro_batch_tokens=0", *extra], cache_dir=cache)


@pytest.fixture(scope="module")
def lora_run(control_folder, data_cache, tmp_path_factory):
    """A LoRA run (rank 4) on the control folder from a pretrained VACE folder of random weights."""
    from dit_train.__main__ import run_from_config

    tmp = tmp_path_factory.mktemp("vace_lora")
    base = folder_cfg(control_folder, data_cache)
    to_diffusers(random_model(base.model, seed=7).state_dict(), base.model).save_pretrained(str(tmp / "pretrained"))
    cfg = folder_cfg(control_folder, data_cache, ["model.lora.rank=4", "model.lora.alpha=8", "optim=adamw",
                                                   "optim.lr=0.01", f"model.pretrained={tmp / 'pretrained'}"])
    cfg.run_dir = str(tmp / "run")
    run_from_config(cfg)
    return cfg, tmp


@pytest.mark.slow
def test_lora_run_adapts_the_vace_blocks_and_loads_in_diffusers(lora_run):
    """The run's LoRA file adapts Wan's and VACE's blocks; diffusers' WanVACETransformer3DModel with
    the pretrained weights + load_lora_adapter, and the merged --diffusers export loaded with
    from_pretrained, both give our packed model's output (with a control context): <= 1e-5."""
    from diffusers import WanVACETransformer3DModel
    from safetensors.torch import load_file

    from dit_train.kernels import VarlenLayout
    from dit_train.models import build_model
    from dit_train.tools.export_weights import main as export

    cfg, tmp = lora_run
    run = tmp / "run"
    adapters = load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))
    assert any(k.startswith("transformer.vace_blocks.") for k in adapters)
    assert any(k.startswith("transformer.blocks.") for k in adapters)
    # the VACE blocks' adapters trained (B starts at 0): the hints reach the loss
    assert any(adapters[k].abs().max() > 0 for k in adapters if "vace_blocks" in k and "lora_B" in k)
    assert export([str(run), "--merge-lora", "--diffusers", str(tmp / "merged")]) == 0
    base = WanVACETransformer3DModel.from_pretrained(str(tmp / "pretrained"))
    base.load_lora_adapter(str(run / "lora"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    merged = WanVACETransformer3DModel.from_pretrained(str(tmp / "merged"))
    cfg.model.lora.rank = 0
    ours = build_model(cfg.model)
    ours.load_state_dict(load_file(str(run / "weights.safetensors")))
    g = torch.Generator().manual_seed(5)
    clip, control = torch.randn(3, 2, 32, 48, generator=g), torch.randn(3, 2, 32, 48, generator=g)
    vace = vace_context(control, None, 1)
    ctx = torch.randn(1, cfg.model.text_len, cfg.model.text_dim, generator=g)
    patch = tuple(cfg.model.patch_size)
    tok, grid = patchify(torch.cat([clip, vace]), patch)
    seg = torch.zeros(tok.shape[0], dtype=torch.long)
    with torch.no_grad():
        mine = unpatchify(ours(tok, grid, seg, torch.tensor([0.4]), VarlenLayout.build(seg, torch.arange(len(seg)), False),
                               ctx, torch.tensor([cfg.model.text_len])), (1, 2, 3), patch, 3)
        for theirs in (base, merged):
            out = theirs(clip[None], torch.tensor([400.0]), ctx, control_hidden_states=vace[None]).sample[0]
            assert float((mine - out).abs().max() / out.abs().max()) <= 1e-5


@pytest.mark.slow
def test_sample_tool_takes_the_control_video(lora_run, control_folder, tmp_path, capsys):
    from dit_train.tools.sample import main

    cfg, tmp = lora_run
    args = [str(tmp / "run"), "--prompt", "a red circle", "--frames", "4", "--height", "32", "--width", "32", "--steps", "2"]
    assert main([*args, "--control", str(control_folder / "clip_0.control.mp4"), "--out", str(tmp_path / "a")]) == 0
    assert len(list((tmp_path / "a").glob("*.mp4"))) == 1
    capsys.readouterr()
    assert main(args) == 2
    assert "error: this run trained with a control video (cond.control=true): give --control" in capsys.readouterr().err
    assert main([str(tmp / "run"), "--data-captions", "2", "--steps", "2", "--out", str(tmp_path / "b")]) == 0


def test_the_cached_context_is_wan_vace_pipelines(models):
    """A control video through tools.cache_latents --control (CompanionEncoder) and
    vace_context is what diffusers' WanVACEPipeline feeds the transformer for that video without a
    mask: cat(prepare_video_latents, prepare_masks) — [VAE(0) | VAE(control) | 64 ones]."""
    from diffusers import WanVACEPipeline

    from dit_train.data_pipelines.latent_cache import CompanionEncoder, VaeCodec
    from dit_train.data_pipelines.video_dataset import VideoSample

    vae = VaeCodec(str(models / "vae"))
    g = torch.Generator().manual_seed(0)
    control = torch.rand(3, 5, 32, 48, generator=g) * 2 - 1
    cached = CompanionEncoder(vae, ("control",)).tensors(VideoSample(torch.zeros(3, 5, 32, 48), "", control=control))
    ours = vace_context(cached["control_latents"], cached["control_inactive_latents"], 64)
    cfg = tiny_vace_cfg(vace_mask_channels=64, vace_layers=[0], cond_channels=2 * C + 64)
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=vae.vae, scheduler=None,
                           transformer=to_diffusers(random_model(cfg).state_dict(), cfg))
    mask = torch.ones(1, 3, 5, 32, 48)  # WanVACEPipeline.preprocess_conditions without a mask
    with torch.no_grad():
        theirs = torch.cat([pipe.prepare_video_latents(control[None], mask, [[]], device="cpu"),
                            pipe.prepare_masks(mask, [[]])], dim=1)[0]
    assert ours.shape == theirs.shape == (2 * C + 64, 2, 4, 6)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- bad input


def test_a_latent_cache_that_cannot_feed_vace_is_refused_before_the_run(companion_cache, tmp_path):
    """The VAE's mask layout must be the model's (64 = 8 x 8 pixels per latent pixel), and a cache
    written before the inactive latents were (or with them lost) is refused, naming the fix."""
    from safetensors.torch import load_file, save_file

    from dit_train.tasks import build_task

    def task(cfg):
        return build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)

    assert task(vace_cache_cfg(companion_cache)).inputs.control_dim == (2 * 4 + 64) * 4
    with pytest.raises(ValueError, match=r"set model.vace_mask_channels=64"):
        task(vace_cache_cfg(companion_cache, ["model.vace_mask_channels=1"]))
    old = tmp_path / "old"
    shutil.copytree(companion_cache, old)
    for f in (old / "samples").glob("*.safetensors"):
        save_file({k: v for k, v in load_file(str(f)).items() if k != "control_inactive_latents"}, str(f))
    with pytest.raises(ValueError, match=r"cached without: cache it again with python -m dit_train.tools.cache_latents --control"):
        task(vace_cache_cfg(old))


@pytest.mark.parametrize("overrides, needle", [
    ([], "model.name=wan_vace reads each clip's control video as its VACE context (7 channels): set cond.control=true"),
    (["cond.control=true", "model.vace_layers=[1]"], "model.vace_layers=[1] must be distinct block indices below "
                                                     "model.depth=2, 0 among them"),
], ids=["no_control", "vace_layers_without_0"])
def test_vace_without_a_control_video_is_refused_before_the_run(overrides, needle):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_config(compose_config(["model=wan_vace_tiny", *overrides]))


def test_a_wan_folder_without_vace_blocks_is_refused(tmp_path):
    from dataclasses import asdict

    vace = tiny_vace_cfg()
    wan = model_config("wan", **{k: v for k, v in asdict(vace).items()
                                 if k not in ("name", "vace_layers", "vace_mask_channels", "cond_channels")})
    to_diffusers(random_model(wan).state_dict(), wan).save_pretrained(str(tmp_path / "t2v"))
    with pytest.raises(ValueError, match="holds a WanTransformer3DModel without VACE blocks"):
        read_pretrained(str(tmp_path / "t2v"), vace)


def test_a_latent_run_trains_and_samples_with_the_control_video(companion_cache, companion_folder, tmp_path, capsys):
    """wan_vace on the --control latent cache trains from the command's config, and tools.sample
    --control builds the context the cache holds: the same inactive latents (the zero video
    through the cache's VAE) and the control video's latents."""
    from safetensors.torch import load_file

    from dit_train.__main__ import run_from_config
    from dit_train.data_pipelines.latent_cache import VaeCodec, read_cache_info
    from dit_train.sampling.conditioned import control_from_file
    from dit_train.tools.sample import main

    cfg = vace_cache_cfg(companion_cache, ["train.steps=1", "train.global_batch=2", "train.micro_batch_tokens=0"])
    cfg.run_dir = str(tmp_path / "run")
    run_from_config(cfg)
    assert main([cfg.run_dir, "--prompt", "a red circle", "--control", str(companion_folder / "c0.control.mp4"),
                 "--frames", "9", "--height", "32", "--width", "32", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    assert len(list((tmp_path / "s").glob("*.mp4"))) == 1
    row = next(r for r in read_manifest(companion_cache) if r["source"].endswith("c0.mp4"))
    cached = load_file(str(companion_cache / row["file"]))
    codec = VaeCodec(read_cache_info(companion_cache)["vae"])
    ours = control_from_file(str(companion_folder / "c0.control.mp4"), tuple(cached["latents"].shape), codec, 64)
    torch.testing.assert_close(ours[:C], cached["control_inactive_latents"], rtol=0, atol=0)
    torch.testing.assert_close(ours[C:2 * C], cached["control_latents"], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours[2 * C:], torch.ones(64, *ours.shape[1:]))


def read_manifest(root):
    import json

    return [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines() if line.strip()]
