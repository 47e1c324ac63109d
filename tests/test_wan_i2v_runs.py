"""The Wan 2.1 I2V layout end to end on a tiny latent cache (docs/wan.md#wan-21-i2v):

1. tools.cache_latents --i2v first_frame --image-encoder caches, per clip, exactly what diffusers'
   WanImageToVideoPipeline builds (prepare_latents' mask + condition latents, encode_image's CLIP
   tokens), and the task packs them as the model's extra input channels and image context.
2. A model=wan_i2v_tiny run trains on it; its --diffusers export loads in WanImageToVideoPipeline
   (Wan 2.1 mode: CLIP image encoder, no expand_timesteps) and samples.
3. Bad input: a cache without --i2v, or of the other kind, refused before the run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dit_train.data_pipelines import latent_cache as lc
from tests.conftest import CLIP_DIM, TEXT_DIM, Z_DIM, compose_config, needs

pytestmark = needs("transformers")

def run_args(cache: Path) -> list[str]:
    return ["model=wan_i2v_tiny", "data=latent_cache", f"data.root={cache}", f"model.in_channels={Z_DIM}",
            f"model.text_dim={TEXT_DIM}", f"model.image_dim={CLIP_DIM}", "cond.kind=first_frame", "cond.feed=concat",
            "train.steps=1", "train.global_batch=2", "train.sample_every=0"]


def pipeline(models: Path, clip_dir: Path, transformer):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionModel

    return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=AutoencoderKLWan.from_pretrained(str(models / "vae")),
                                   scheduler=FlowMatchEulerDiscreteScheduler(), transformer=transformer,
                                   image_encoder=CLIPVisionModel.from_pretrained(str(clip_dir / "image_encoder")),
                                   image_processor=CLIPImageProcessor.from_pretrained(str(clip_dir / "image_processor")))


def first_clip(cache: Path) -> tuple[torch.Tensor, dict]:
    """(pixels [3, F, H, W] of the cache's first clip as the cache tool read them, its cached tensors)."""
    from safetensors.torch import load_file

    from dit_train.data_pipelines import source_for

    cfg = compose_config(["data=video_folder", f"data.root={lc.read_cache_info(cache)['settings']['source']['root']}",
                          "data.max_frames=5", "data.resolution_buckets=null"], cache_dir=str(cache.parent / "probe_cache"))
    pixels = source_for(cfg.data, cfg.model).pixel_dataset((1, 8, 8), cache_items=0)
    row = json.loads((cache / lc.MANIFEST).read_text().splitlines()[0])
    x = pixels[{e.path: i for i, e in enumerate(pixels.entries)}[row["source"]]].pixels
    return x, load_file(str(cache / row["file"]))


def test_the_pack_holds_diffusers_i2v_mask_condition_and_image_tokens(i2v_cache, models, clip_dir):
    """Our packed extra channels of a clip = WanImageToVideoPipeline.prepare_latents' 20 (here
    4 + Z_DIM) condition channels, patchified; the image context = its encode_image."""
    from dit_train.data_pipelines.i2v_cache import to_uint8_image
    from dit_train.tasks import build_task
    from dit_train.tasks.video import patchify

    x, tensors = first_clip(i2v_cache)
    H, W = x.shape[2:]
    pipe = pipeline(models, clip_dir, None)
    with torch.no_grad():
        _, cond = pipe.prepare_latents(x[:, 0][None], 1, Z_DIM, H, W, x.shape[1], torch.float32, "cpu",
                                       torch.Generator().manual_seed(0))
        image = pipe.encode_image(to_uint8_image(x[:, 0]), "cpu")
    assert cond.shape == (1, 4 + Z_DIM, 2, H // 8, W // 8)
    torch.testing.assert_close(tensors["cond_latents"], cond[0, 4:], rtol=0, atol=1e-5)
    torch.testing.assert_close(tensors["image_emb"], image[0], rtol=0, atol=1e-5)

    cfg = compose_config(run_args(i2v_cache))
    assert cfg.model.cond_channels == 4 + Z_DIM
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
    row = json.loads((i2v_cache / lc.MANIFEST).read_text().splitlines()[0])
    sid = [r["file"] for r in task.dataset.rows].index(row["file"])
    batch = task.build([sid], step=0)
    want, _ = patchify(cond[0], (1, 2, 2))
    torch.testing.assert_close(batch.tokens["cond"], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(batch.samples["image"][0], image[0], rtol=0, atol=1e-5)
    assert int(batch.weight.min()) == lc_weight_one()  # every token a target, as Wan 2.1 I2V trains


def lc_weight_one() -> int:
    from dit_train.batch import WEIGHT_ONE

    return WEIGHT_ONE


def test_an_i2v_run_exports_to_wan_image_to_video_pipeline(i2v_cache, models, clip_dir, tmp_path, capsys):
    """model=wan_i2v_tiny trains one step on the I2V cache; the --diffusers export loads in
    WanImageToVideoPipeline (Wan 2.1 mode, CLIP image encoder) and samples a clip from the image."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from dit_train.__main__ import run_from_config
    from dit_train.data_pipelines.i2v_cache import to_uint8_image
    from dit_train.tools.export_weights import main as export

    # validation samples the clips from their cached condition latents and image tokens
    cfg = compose_config([*run_args(i2v_cache), "model.init=normal", "train.sample_every=1", "train.num_samples=2",
                          "train.sample_steps=2"])
    cfg.run_dir = str(tmp_path / "run")
    run_from_config(cfg)
    assert sorted(p.name for p in (Path(cfg.run_dir) / "samples").glob("step_*/*.mp4"))[:1], "no validation videos"
    assert export([cfg.run_dir, "--diffusers", str(tmp_path / "dif")]) == 0
    transformer = WanTransformer3DModel.from_pretrained(str(tmp_path / "dif"))
    assert transformer.config.in_channels == 4 + 2 * Z_DIM and transformer.config.image_dim == CLIP_DIM
    trained = load_file(str(Path(cfg.run_dir) / "weights.safetensors"))
    torch.testing.assert_close(transformer.state_dict()["condition_embedder.image_embedder.ff.net.0.proj.weight"],
                               trained["condition_embedder.image_embedder.ff.net.0.proj.weight"])
    x, tensors = first_clip(i2v_cache)
    H, W = x.shape[2:]
    emb = torch.nn.functional.pad(tensors["text_emb"], (0, 0, 0, 512 - tensors["text_emb"].shape[0]))
    with torch.no_grad():
        out = pipeline(models, clip_dir, transformer)(
            image=to_uint8_image(x[:, 0]), prompt_embeds=emb[None], height=H, width=W, num_frames=5, num_inference_steps=2,
            guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    assert out.shape == (1, Z_DIM, 2, H // 8, W // 8) and torch.isfinite(out).all()

    # our sampler (tools.sample --image's path: the PNG through the cache's VAE and CLIP) from the
    # same starting noise gives the pipeline's clip
    from PIL import Image

    from dit_train.config.schema import ParallelConfig
    from dit_train.models import build_model
    from dit_train.models.init import load_full_weights
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling.conditioned import i2v_from_files
    from dit_train.sampling.sampler import SampleRequest, VideoSampler
    from dit_train.tasks.video_inputs import video_inputs
    from dit_train.rng import sample_generator

    png = tmp_path / "first.png"
    to_uint8_image(x[:, 0]).save(png)
    shape = (Z_DIM, 2, H // 8, W // 8)
    given, patches, cond_latents, image = i2v_from_files(cfg.cond, shape, lc.VaeCodec(str(models / "vae")),
                                                         lc.read_cache_info(i2v_cache), str(png))
    torch.testing.assert_close(cond_latents, tensors["cond_latents"], rtol=0, atol=1e-5)
    request = SampleRequest("p", shape, "", tensors["text_emb"], 0, given=given, given_patches=patches,
                            cond_latents=cond_latents, image=image)
    model = build_model(cfg.model)
    load_full_weights(model, trained)
    inputs = video_inputs(cfg.model, cfg.cond)  # the tiny I2V model's: patch (1, 2, 2), TEXT_DIM, the concat feed
    assert inputs.patch == (1, 2, 2) and inputs.text_dim == TEXT_DIM and inputs.i2v_mask
    ours = VideoSampler([request], inputs, None, init_parallel(ParallelConfig(device="cpu")), 2, 1.0, 0).sample(model)[0]
    noise = torch.randn(shape, generator=sample_generator(0, 0, 0, "sampling"))
    with torch.no_grad():
        theirs = pipeline(models, clip_dir, transformer)(
            image=Image.open(png), prompt_embeds=emb[None], height=H, width=W, num_frames=5, num_inference_steps=2,
            guidance_scale=1.0, output_type="latent", latents=noise[None]).frames[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    from dit_train.tools.sample import main as sample  # the commands of docs/wan.md#wan-21-i2v

    assert sample([cfg.run_dir, "--prompt", "a clip", "--image", str(png), "--frames", "5", "--height", str(H),
                   "--width", str(W), "--steps", "2", "--out", str(tmp_path / "gen")]) == 0
    assert sample([cfg.run_dir, "--data-captions", "2", "--steps", "2", "--out", str(tmp_path / "gen2")]) == 0
    capsys.readouterr()
    assert sample([cfg.run_dir, "--prompt", "a clip", "--frames", "5", "--out", str(tmp_path / "gen3")]) == 2
    assert "Wan 2.1 I2V layout (model.mask_channels=4): give --image first.png" in capsys.readouterr().err


def test_i2v_runs_refuse_caches_without_their_tensors(cache, i2v_cache):
    """A cache written without --i2v, or for first_frame when the run is first_last: one line
    before the run, naming the flag."""
    from dit_train.config.errors import ConfigError
    from dit_train.tasks import check_data

    with pytest.raises(ConfigError, match="has no I2V condition latents .*--i2v first_frame --image-encoder"):
        check_data(compose_config(run_args(cache)))
    with pytest.raises(ConfigError, match="for cond.kind=first_frame, not cond.kind=first_last"):
        check_data(compose_config([*run_args(i2v_cache), "cond.kind=first_last"]))


@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
def test_an_i2v_lora_run_from_a_pretrained_i2v_folder_loads_in_the_pipeline(i2v_cache, models, clip_dir, tmp_path):
    """LoRA on a pretrained Wan 2.1 I2V folder (its 36-channel-style patch embedding already
    reads the mask and condition: nothing is widened, so LoRA is allowed): the run's --diffusers
    adapters load with load_lora_weights into WanImageToVideoPipeline and change its sample."""
    from diffusers import WanTransformer3DModel

    from dit_train.__main__ import run_from_config
    from dit_train.data_pipelines.i2v_cache import to_uint8_image
    from dit_train.models.diffusers_family import to_diffusers
    from dit_train.tools.export_weights import main as export
    from tests.families import random_model

    plain = compose_config(run_args(i2v_cache))
    to_diffusers(random_model(plain.model).state_dict(), plain.model).save_pretrained(str(tmp_path / "pre"))
    cfg = compose_config([*run_args(i2v_cache), f"model.pretrained={tmp_path / 'pre'}", "model.lora.rank=2", "optim.lr=0.05"])
    cfg.run_dir = str(tmp_path / "run")
    run_from_config(cfg)
    assert export([cfg.run_dir, "--diffusers", str(tmp_path / "lora")]) == 0
    assert export([cfg.run_dir, "--merge-lora", "--diffusers", str(tmp_path / "merged")]) == 0
    x, tensors = first_clip(i2v_cache)
    H, W = x.shape[2:]
    emb = torch.nn.functional.pad(tensors["text_emb"], (0, 0, 0, 512 - tensors["text_emb"].shape[0]))
    outs = []
    for lora in (False, True, "merged"):
        pipe = pipeline(models, clip_dir, WanTransformer3DModel.from_pretrained(str(tmp_path / ("merged" if lora == "merged" else "pre"))))
        if lora is True:
            pipe.load_lora_weights(str(tmp_path / "lora"))
            assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
        with torch.no_grad():
            outs.append(pipe(image=to_uint8_image(x[:, 0]), prompt_embeds=emb[None], height=H, width=W, num_frames=5,
                             num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                             generator=torch.Generator().manual_seed(0)).frames)
    assert torch.isfinite(outs[1]).all() and (outs[1] - outs[0]).abs().max() > 1e-4
    # diffusers adds zero image-branch (add_k_proj / add_v_proj) adapters to a LoRA without them
    # (_maybe_expand_t2v_lora_for_i2v, peft warns): the file still gives the trained model
    torch.testing.assert_close(outs[1], outs[2], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["first_frame", "first_last"])
def test_mask_and_condition_equal_prepare_latents_for_both_kinds(kind, models, clip_dir):
    """i2v_mask and the condition clip through the VAE (what the cache stores) equal
    WanImageToVideoPipeline.prepare_latents' 4 + C channels, with and without a last image."""
    from dit_train.data_pipelines.i2v_cache import condition_clip
    from dit_train.tasks.conditioning import frame_mask, i2v_mask

    pixels = torch.rand(3, 9, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    last = pixels[:, -1][None] if kind == "first_last" else None
    with torch.no_grad():
        _, cond = pipeline(models, clip_dir, None).prepare_latents(pixels[:, 0][None], 1, Z_DIM, 16, 16, 9, torch.float32, "cpu",
                                                                  torch.Generator().manual_seed(0), last_image=last)
    patches = torch.tensor([True, False, kind == "first_last"])
    mask = i2v_mask(frame_mask(patches, 1, 3), kind == "first_last", 4)
    torch.testing.assert_close(mask[:, :, None, None].expand(4, 3, 2, 2), cond[0, :4], rtol=0, atol=0)
    vae = lc.VaeCodec(str(models / "vae"))
    torch.testing.assert_close(vae.encode(condition_clip(pixels, kind, 9)), cond[0, 4:], rtol=0, atol=1e-5)
