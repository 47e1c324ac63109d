"""Latent cache: a tiny random AutoencoderKLWan + tiny T5 encoder saved by the test, the cache
tool (single process and 2 local workers), resuming, reading back, decoding, and training. The
models, the clips and the one-process cache are session fixtures (tests/conftest.py): the latent
shard tests compare with the same cache."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dit_train.data_pipelines import latent_cache as lc
from dit_train.data_pipelines.video_io import VideoReadError
from tests.conftest import LATENT_MEAN as MEAN, LATENT_STD as STD, TEXT_DIM, TINY_MODEL, Z_DIM, cache_args, compose_config, needs

pytestmark = needs("transformers")

def test_cache_layout_shapes_and_report(cache, source, models):
    meta = lc.read_cache_info(cache)
    assert meta["latent_channels"] == Z_DIM and meta["text_dim"] == TEXT_DIM and meta["vae_class"] == "AutoencoderKLWan"
    assert (meta["scale_factor_temporal"], meta["scale_factor_spatial"]) == (4, 8)
    assert meta["latents_mean"] == MEAN and meta["latents_std"] == STD
    rows = [json.loads(line) for line in (cache / lc.MANIFEST).read_text().splitlines()]
    assert len(rows) == 5
    report = json.loads((cache / lc.REPORT).read_text())
    assert report["encoded"] == 5 and [Path(p).name for p, _ in report["skipped_by_source"]] == ["broken.mp4"]
    from dit_train.data_pipelines.video_io import probe

    for r in rows:
        info = probe(r["source"])
        frames = min(info.frames, 5)
        assert r["latent_shape"] == [Z_DIM, 1 + (frames - 1) // 4, info.height // 8, info.width // 8]
        from safetensors.torch import load_file

        t = load_file(str(cache / r["file"]))
        assert list(t["latents"].shape) == r["latent_shape"] and t["latents"].dtype == torch.float32
        # only valid tokens: ByT5 = one id per UTF-8 byte + EOS
        assert t["text_emb"].shape == (len(r["caption"].encode()) + 1, TEXT_DIM) == (r["text_len"], TEXT_DIM)


def test_latents_are_normalized_vae_modes(cache, models):
    """The stored latents are (mode(z) - latents_mean) / latents_std of the clip's frames."""
    from diffusers import AutoencoderKLWan

    from dit_train.data_pipelines import source_for

    cfg = compose_config(["data=video_folder", f"data.root={lc.read_cache_info(cache)['settings']['source']['root']}",
                          "data.max_frames=5", "data.resolution_buckets=null"], cache_dir=str(cache.parent / "probe_cache"))
    pixels = source_for(cfg.data, cfg.model).pixel_dataset((1, 8, 8), cache_items=0)
    entry_ids = {e.path: i for i, e in enumerate(pixels.entries)}
    row = json.loads((cache / lc.MANIFEST).read_text().splitlines()[0])
    x = pixels[entry_ids[row["source"]]].pixels
    x = x[:, : 1 + (x.shape[1] - 1) // 4 * 4]
    vae = AutoencoderKLWan.from_pretrained(str(models / "vae")).eval()
    with torch.no_grad():
        z = vae.encode(x.unsqueeze(0)).latent_dist.mode()[0]
    want = (z - torch.tensor(MEAN).view(-1, 1, 1, 1)) / torch.tensor(STD).view(-1, 1, 1, 1)
    from safetensors.torch import load_file

    assert torch.allclose(load_file(str(cache / row["file"]))["latents"], want, atol=1e-5)


def test_dataset_reads_latents_text_and_null_caption(cache):
    ds = lc.LatentCacheDataset(cache, patch=(1, 2, 2))
    assert len(ds) == 5 and ds.text_dim == TEXT_DIM and ds.latent_channels == Z_DIM
    for i in range(len(ds)):
        s = ds[i]
        c, f, h, w = s.pixels.shape
        assert c == Z_DIM and h % 2 == 0 and w % 2 == 0 and ds.num_tokens(i) == f * (h // 2) * (w // 2)
        assert s.text_emb.shape[1] == TEXT_DIM and s.text_emb.dtype == torch.float32
    assert ds.null_text_emb().shape == (1, TEXT_DIM)  # the empty caption is just EOS
    # a patch larger than every latent grid: a clear error that names the key
    with pytest.raises(ValueError, match="model.patch_size"):
        lc.LatentCacheDataset(cache, patch=(1, 100, 100))


def test_decode_of_encode_has_the_pixel_shape(cache):
    ds = lc.LatentCacheDataset(cache, patch=(1, 1, 1))
    decode = lc.load_decoder(cache, "cpu")
    z = ds[0].pixels
    x = decode(z)
    c, f, h, w = z.shape
    assert x.shape == (3, 1 + 4 * (f - 1), 8 * h, 8 * w) and float(x.abs().max()) <= 1.0


def test_resume_encodes_only_what_is_missing(cache, models, source):
    from tools.cache_latents import main

    files = sorted((cache / lc.SAMPLES).iterdir())
    stamps = {p: p.stat().st_mtime_ns for p in files}
    files[1].unlink()
    args = cache_args(models, source, cache, cache.parent / "probe_cache")
    assert main(args) == 0
    report = json.loads((cache / lc.REPORT).read_text())
    assert (report["encoded"], report["reused"], report["samples"]) == (1, 4, 5)
    assert all(p.stat().st_mtime_ns == stamps[p] for p in files if p != files[1])
    assert main(args) == 0
    assert json.loads((cache / lc.REPORT).read_text())["encoded"] == 0
    # other settings into the same folder: refused
    assert main(args + ["data.max_frames=9"]) == 1


def test_missing_sample_file_is_a_read_error(cache, tmp_path):
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(cache, copy)
    ds = lc.LatentCacheDataset(copy, patch=(1, 2, 2))
    (copy / ds.rows[2]["file"]).unlink()
    with pytest.raises(VideoReadError):
        ds[2]


@pytest.mark.slow
def test_two_workers_write_the_same_cache(cache, models, source, tmp_path):
    from safetensors.torch import load_file

    from tools.cache_latents import main

    out = tmp_path / "sharded"
    assert main(cache_args(models, source, out, cache.parent / "probe_cache", "--workers", "2")) == 0
    assert (out / lc.MANIFEST).read_text() == (cache / lc.MANIFEST).read_text()
    for row in map(json.loads, (out / lc.MANIFEST).read_text().splitlines()):
        a, b = load_file(str(out / row["file"])), load_file(str(cache / row["file"]))
        assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["text_emb"], b["text_emb"])


def test_in_channels_must_match_the_cache(cache):
    from dit_train.tasks import check_data
    from dit_train.config.errors import ConfigError

    cfg = compose_config(TINY_MODEL + ["data=latent_cache", f"data.root={cache}", "model.patch_size=[1,2,2]", "train.global_batch=3"])
    with pytest.raises(ConfigError, match=f"set model.in_channels={Z_DIM}"):
        check_data(cfg)
    cfg.model.in_channels = Z_DIM
    with pytest.raises(ConfigError, match=f"set model.text_dim={TEXT_DIM}"):
        check_data(cfg)  # the tiny default model reads 32-wide captions; the cache holds 16-wide ones
    cfg.model.text_dim = TEXT_DIM
    check_data(cfg)
    from dit_train.tasks import build_task

    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)  # data.num_workers=2: prefetched
    assert task.dataset.text_dim == TEXT_DIM and task.dataset.null_text_emb().shape == (1, TEXT_DIM)
    task.prefetch([0, 1])
    assert task.dataset[1].text_emb.shape[1] == TEXT_DIM


def test_training_on_latents(cache, tmp_path):
    """The whole entry path (validate, check_data, launch, train) in this process, 3 steps, with
    cross-attention to the cached caption embeddings and validation videos decoded by the VAE."""
    from safetensors.torch import load_file

    from dit_train.data_pipelines.video_io import probe
    from dit_train.__main__ import run_from_config

    run_dir = tmp_path / "run"
    cfg = compose_config(TINY_MODEL + ["data=latent_cache", f"data.root={cache}", f"model.in_channels={Z_DIM}",
                                 f"model.text_dim={TEXT_DIM}", "model.patch_size=[1,2,2]", "train.steps=3",
                                 "train.global_batch=3", "train.sample_every=3", "train.sample_steps=2",
                                 "train.num_samples=2", "train.guidance_scale=2.0"])
    cfg.run_dir = str(run_dir)
    assert run_from_config(cfg)["steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["samples"] == 3 and r["tokens"] > 0 for r in rows)
    out = run_dir / "samples" / "step_000003"
    # samples.safetensors holds the VAE-decoded pixels in [-1, 1]; the run sampled latents of the
    # cached clips' shapes (the first two manifest rows)
    pixels = load_file(out / "samples.safetensors")
    assert len(pixels) == 2 and (out / "grid.png").exists()
    shapes = [json.loads(line)["latent_shape"] for line in (Path(cache) / lc.MANIFEST).read_text().splitlines()[:2]]
    for (key, x), (_, f, h, w) in zip(sorted(pixels.items(), key=lambda kv: int(kv[0].split("_")[1])), shapes):
        assert x.shape == (3, 1 + 4 * (f - 1), 8 * h, 8 * w)  # the Wan VAE's temporal and spatial factors
        assert float(x.abs().max()) <= 1.0
        video = probe(str(out / f"{key}.mp4"))  # decord, or PyAV where decord has no wheel
        assert (video.frames, video.height, video.width) == tuple(x.shape[1:])
    # prompts: encoded with the cache's text encoder, latents decoded with its VAE
    from dit_train.tools.sample import main as sample

    gen = tmp_path / "gen"
    assert sample([str(run_dir), "--prompt", "a clip of waves", "--frames", "5", "--height", "16", "--width", "32",
                   "--steps", "2", "--out", str(gen)]) == 0
    (x,) = load_file(gen / "samples.safetensors").values()
    assert x.shape == (3, 5, 16, 32)  # 5 frames -> 2 latent frames -> 1 + 4 decoded; 16x32 px -> 2x4 latents


def test_shards_split_clips_by_rank_and_count_unreadable(tmp_path):
    """Clip i goes to rank i % world; a clip that fails to decode is listed, not fatal."""
    from types import SimpleNamespace

    from dit_train.data_pipelines.video_dataset import VideoSample

    class Clips:
        entries = [SimpleNamespace(path=f"/videos/{i}.mp4", caption=f"clip {i}") for i in range(5)]

        def __len__(self):
            return 5

        def __getitem__(self, i):
            if i == 3:
                raise VideoReadError("truncated")
            return VideoSample(torch.full((3, 1, 8, 8), float(i)), "")

    class Codec:
        seen = []

        def encode(self, x):
            Codec.seen.append(int(x[0, 0, 0, 0]))
            return x[:1, :, :1, :1].clone()

    r0 = lc.encode_shard(Clips(), tmp_path, Codec(), None, rank=0, world=2, progress=False)
    assert Codec.seen == [0, 2, 4]
    r1 = lc.encode_shard(Clips(), tmp_path, Codec(), None, rank=1, world=2, progress=False)
    assert Codec.seen == [0, 2, 4, 1] and r1["unreadable"] == [["/videos/3.mp4", "truncated"]]
    report = lc.write_manifest(tmp_path, Clips(), [r0, r1])
    assert (report["samples"], report["encoded"], len(report["unreadable"])) == (4, 4, 1)
    rows = [json.loads(line) for line in (tmp_path / lc.MANIFEST).read_text().splitlines()]
    assert [r["source"] for r in rows] == ["/videos/0.mp4", "/videos/1.mp4", "/videos/2.mp4", "/videos/4.mp4"]
    assert all(r["text_len"] == 0 for r in rows)  # cached without a text encoder


# -- conditioning on a latent cache (docs/conditioning.md) ----------------------------------------

def _first_clip(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels [3, F, H, W] of the cache's first clip as the cache tool read them, its cached latents)."""
    from safetensors.torch import load_file

    from dit_train.data_pipelines import source_for

    cfg = compose_config(["data=video_folder", f"data.root={lc.read_cache_info(cache)['settings']['source']['root']}",
                          "data.max_frames=5", "data.resolution_buckets=null"], cache_dir=str(cache.parent / "probe_cache"))
    pixels = source_for(cfg.data, cfg.model).pixel_dataset((1, 8, 8), cache_items=0)
    row = json.loads((cache / lc.MANIFEST).read_text().splitlines()[0])
    x = pixels[{e.path: i for i, e in enumerate(pixels.entries)}[row["source"]]].pixels
    return x, load_file(str(cache / row["file"]))["latents"]


def test_the_first_latent_frame_is_the_first_image_encoded_alone(cache, models):
    """Wan's causal VAE encodes frame 0 on its own: the cached clip's first latent frame is its
    first image encoded alone — what image-to-video needs is already in the cache."""
    x, z = _first_clip(cache)
    assert z.shape[1] >= 2  # a later latent frame exists (and is not compared)
    alone = lc.VaeCodec(str(models / "vae")).encode(x[:, :1])
    assert alone.shape[1] == 1 and torch.allclose(z[:, :1], alone, atol=1e-5)


def test_sample_image_on_a_latent_run_goes_through_the_cache_vae(cache, tmp_path, capsys):
    """tools.sample --image on a latent-cache run: the image is encoded by the cache's VAE and
    given as the first latent frame — for a clip's own first frame, exactly its cached first
    latent frame; the whole tool runs; --last-image (first_last) is refused in one line."""
    import argparse

    from PIL import Image

    from dit_train.__main__ import run_from_config
    from dit_train.tools.sample import main as sample, read_given

    x, z = _first_clip(cache)
    png = tmp_path / "first.png"
    Image.fromarray(((x[:, 0] + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()).save(png)
    base = TINY_MODEL + ["data=latent_cache", f"data.root={cache}", f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}",
                         "model.patch_size=[1,2,2]", "train.steps=2", "train.global_batch=2", "train.sample_every=0"]
    cfg = compose_config([*base, "cond.kind=first_frame"])
    H, W = x.shape[2:]
    args = argparse.Namespace(image=str(png), last_image="", video="", prefix_frames=0, frames=5, height=H, width=W)
    given, patches = read_given(args, cfg)
    assert given.shape == (Z_DIM, 2, H // 8, W // 8) and patches.tolist() == [True, False]
    assert torch.allclose(given[:, :1], z[:, :1], atol=1e-4) and not given[:, 1:].any()

    prefix = compose_config([*base, "cond.kind=prefix", "cond.prefix_frames=1"])  # the clip's own video, 1 latent frame
    video = json.loads((cache / lc.MANIFEST).read_text().splitlines()[0])["source"]
    pgiven, ppatches = read_given(argparse.Namespace(**{**vars(args), "image": "", "video": video, "prefix_frames": 1}), prefix)
    assert ppatches.tolist() == [True, False] and torch.allclose(pgiven[:, :1], z[:, :1], atol=1e-4)

    cfg.run_dir = str(tmp_path / "run")
    run_from_config(cfg)
    assert sample([cfg.run_dir, "--prompt", "a clip", "--image", str(png), "--frames", "5", "--height", str(H),
                   "--width", str(W), "--steps", "2", "--out", str(tmp_path / "gen")]) == 0
    flf = compose_config([*base, "cond.kind=first_last"])
    with pytest.raises(ValueError, match="--last-image on a latent-cache run"):
        read_given(argparse.Namespace(**{**vars(args), "last_image": str(png), "frames": 9}), flf)


def test_a_latent_i2v_wan_run_samples_in_diffusers_wan_image_to_video_pipeline(cache, models, tmp_path):
    """model=wan_tiny on the cache with cond.kind=first_frame (timestep feed, Wan 2.2 TI2V's
    layout): the exported transformer (full weights, and a LoRA file onto its exported base) loads
    in diffusers' WanImageToVideoPipeline(expand_timesteps=True) and samples a clip from the first
    image, whose first latent frame — the pipeline encodes the image alone — is the cached one."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from PIL import Image
    from safetensors.torch import load_file

    from dit_train.__main__ import run_from_config
    from dit_train.tools.export_weights import main as export

    x, z = _first_clip(cache)
    H, W = x.shape[2:]
    image = Image.fromarray(((x[:, 0] + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy())
    emb = load_file(str(cache / json.loads((cache / lc.MANIFEST).read_text().splitlines()[0])["file"]))["text_emb"]
    base = ["model=wan_tiny", "data=latent_cache", f"data.root={cache}", f"model.in_channels={Z_DIM}",
            f"model.text_dim={TEXT_DIM}", "model.patch_size=[1,2,2]", "train.steps=1", "train.global_batch=2",
            "train.sample_every=0", "cond.kind=first_frame"]
    transformers = {}
    for name, extra in (("full", []), ("lora", ["model.lora.rank=2", "model.init=normal"])):
        cfg = compose_config([*base, *extra])
        cfg.run_dir = str(tmp_path / name)
        run_from_config(cfg)
        if name == "full":
            assert export([cfg.run_dir, "--diffusers", str(tmp_path / "full_dif")]) == 0
            transformers[name] = (WanTransformer3DModel.from_pretrained(str(tmp_path / "full_dif")), None)
        else:
            assert export([cfg.run_dir, "--base", "--diffusers", str(tmp_path / "lora_base")]) == 0
            assert export([cfg.run_dir, "--diffusers", str(tmp_path / "lora_dif")]) == 0
            transformers[name] = (WanTransformer3DModel.from_pretrained(str(tmp_path / "lora_base")), tmp_path / "lora_dif")
    vae = AutoencoderKLWan.from_pretrained(str(models / "vae"))
    for name, (transformer, lora) in transformers.items():
        pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                                       transformer=transformer, expand_timesteps=True)
        if lora is not None:
            pipe.load_lora_weights(str(lora))
            assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
        with torch.no_grad():
            out = pipe(image=image, prompt_embeds=emb[None], height=H, width=W, num_frames=5, num_inference_steps=2,
                       guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
        assert out.shape == (1, Z_DIM, 2, H // 8, W // 8) and torch.isfinite(out).all(), name
        torch.testing.assert_close(out[0, :, :1], z[:, :1], rtol=0, atol=1e-4)  # the cached first latent frame
        assert (out[0, :, 1:] - z[:, 1:]).abs().max() > 1e-3  # the rest was generated


@pytest.mark.parametrize("forged", ["../../../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors"])
def test_a_manifest_entry_outside_the_cache_is_refused_before_reading(cache, tmp_path, forged):
    """A manifest is input from whoever wrote it: an entry that leaves the cache folder (.., an
    absolute path into another cache) is one error naming the manifest, before any file opens."""
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(cache, copy)
    lines = (copy / lc.MANIFEST).read_text().splitlines()
    row = json.loads(lines[1])
    row["file"] = forged
    (copy / lc.MANIFEST).write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match="a data file may only name files inside its own folder") as err:
        lc.LatentCacheDataset(copy, patch=(1, 2, 2))
    assert str(copy / lc.MANIFEST) in str(err.value) and repr(forged) in str(err.value)


def test_a_damaged_null_caption_file_is_refused_when_the_dataset_is_built(cache, tmp_path):
    """null_text_emb.safetensors is read at every caption dropout: damaged, it was a traceback in
    the middle of the run; now one error naming it when the dataset is built, before step 0."""
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(cache, copy)
    name = json.loads((copy / lc.META).read_text())["null_text_emb"]
    (copy / name).write_bytes((copy / name).read_bytes()[:20])
    with pytest.raises(ValueError, match=rf"{name} is damaged .*tools.cache_latents"):
        lc.LatentCacheDataset(copy, patch=(1, 2, 2))


def test_a_vae_folder_without_safetensors_is_one_error_naming_it(models, tmp_path):
    """tools.sample --image on a latent run whose cache VAE folder held no safetensors was a
    diffusers EnvironmentError traceback."""
    import shutil

    vae = tmp_path / "vae"
    shutil.copytree(models / "vae", vae)
    for f in vae.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ValueError, match=rf"the VAE folder {vae} cannot be loaded .*safetensors"):
        lc.VaeCodec(str(vae))



def test_a_failing_local_worker_ends_the_tool_with_one_error_line(models, source, tmp_path, capsys, monkeypatch):
    """--workers 2 starts its workers with engine.launch.launch_local, which raises WorkerFailure
    ("worker rank 1 failed ...": tests/test_distributed.py) once a worker fails and the others were
    stopped; the tool ends with that one `error:` line, not a traceback. The launcher is stood in
    for: the real one costs ~22 CPU-s here (a fork server, 2 workers) for what test_distributed checks."""
    from dit_train.config.errors import WorkerFailure
    from dit_train.engine import launch
    from dit_train.tools import cache_latents

    calls = []

    def failing_launch(fn, args, nproc, cfg):
        calls.append((fn, nproc))
        raise WorkerFailure("worker rank 1 failed (exit code 1): ValueError: boom")

    monkeypatch.setattr(launch, "launch_local", failing_launch)
    assert cache_latents.main(cache_args(models, source, tmp_path / "out", tmp_path / "probe", "--workers", "2")) == 1
    assert calls == [(cache_latents._local_worker, 2)]
    assert capsys.readouterr().err == "error: worker rank 1 failed (exit code 1): ValueError: boom\n"


def test_a_default_group_of_another_size_is_refused(monkeypatch):
    """A rank function handed an existing default group (the tests' pooled workers, a caller's)
    uses it only if it holds the run's `world` processes: collectives over another size would hang
    or split the clips wrongly."""
    import torch.distributed as dist

    from dit_train.tools.cache_latents import run_rank

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    with pytest.raises(ValueError, match="a process group of 4 processes exists but this cache run is for 2"):
        run_rank(0, 2, 0, None, None, None)
