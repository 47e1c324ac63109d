"""LTX-2's audio latents in the latent cache and latent shards (`tools.cache_latents --audio-vae`,
data_pipelines/audio_latents.py; docs/audio-video.md#audio-latents).

Tiny random components saved with save_pretrained (nothing downloaded): an AutoencoderKLLTX2Audio
with LTX-2's 4x time and mel compression (2 latent channels x 16 mel bins / 4 = 8 features a
token) and an LTX2Vocoder (160 samples a mel frame), beside the tiny Wan VAE and T5 of the latent
cache tests (tests/conftest.py). The clips: the embedded world with sound (tone + clicks, a
quarter silent films), one track overwritten with silence and one with a corrupt file.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import TEXT_DIM, Z_DIM, compose_config

MEL_BINS, LATENT_C = 16, 2
SOUND_SET = ["data=synthetic_video", "data.audio=true", "data.num_clips=8", "data.gen_seed=3", "data.frames=[6,10]",
             "data.max_frames=9", "data.resolution_buckets=null"]
TOKEN_DIM = LATENT_C * MEL_BINS // 4


@pytest.fixture(scope="module")
def ltx2_audio(tmp_path_factory) -> Path:
    """A pipeline-shaped folder: audio_vae/ and vocoder/."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    d = tmp_path_factory.mktemp("ltx2_audio")
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Audio(base_channels=TOKEN_DIM, ch_mult=(1, 2, 4), num_res_blocks=1, resolution=32,
                                 latent_channels=LATENT_C, mel_bins=MEL_BINS)
    vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, TOKEN_DIM))  # not the identity: the normalisation shows
    vae.latents_std.copy_(torch.linspace(0.5, 2.0, TOKEN_DIM))
    vae.save_pretrained(d / "audio_vae")
    LTX2Vocoder(in_channels=2 * MEL_BINS, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[16, 8, 15],
                upsample_factors=[8, 4, 5], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                output_sampling_rate=16000).save_pretrained(d / "vocoder")
    return d


@pytest.fixture(scope="module")
def sound_clips(tmp_path_factory) -> Path:
    """The embedded world's clips with sound (manifest.jsonl): one track made silent, one corrupt."""
    from dit_train.data_pipelines import prepare_data, source_for
    from dit_train.data_pipelines.synthetic_video import write_wav
    from dit_train.tools.cache_latents import compose_data

    # the set the cache tool reads (written once, then left as it is: the changes below stay)
    data = compose_data([*SOUND_SET, f"data.cache_dir={tmp_path_factory.mktemp('sound_clips')}"])
    prepare_data(data)
    root = source_for(data, None).directory()
    rows = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    with_sound = [r for r in rows if "audio" in r]
    write_wav(root / with_sound[0]["audio"], np.zeros(16000, np.float32))
    (root / with_sound[1]["audio"]).write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(64))
    return root


def audio_cache_args(models: Path, clips: Path, ltx2_audio: Path, out: Path, *extra: str) -> list[str]:
    return ["--vae", str(models / "vae"), "--text-encoder", str(models / "text"), "--out", str(out), "--no-progress",
            "--audio-vae", str(ltx2_audio), *SOUND_SET, f"data.cache_dir={clips.parent}", *extra]


@pytest.fixture(scope="module")
def audio_cache(models, sound_clips, ltx2_audio, tmp_path_factory) -> Path:
    from dit_train.tools.cache_latents import main

    out = tmp_path_factory.mktemp("audio_latents")
    assert main(audio_cache_args(models, sound_clips, ltx2_audio, out)) == 0
    return out


def oracle_tokens(ltx2_audio: Path, wave: torch.Tensor) -> torch.Tensor:
    """The pipeline's tokens of `wave`, built apart from the cache's code: transformers' numpy
    log-mel (the Echo encode path's settings), the VAE's mode, LTX2Pipeline's pack and normalise."""
    from diffusers import AutoencoderKLLTX2Audio, LTX2Pipeline
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    vae = AutoencoderKLLTX2Audio.from_pretrained(ltx2_audio / "audio_vae").eval()
    fb = mel_filter_bank(num_frequency_bins=513, num_mel_filters=MEL_BINS, min_frequency=0.0, max_frequency=8000.0,
                         sampling_rate=16000, norm="slaney", mel_scale="slaney")
    x = np.pad(wave.double().numpy(), (0, max(0, 1024 - wave.numel())))
    mel = spectrogram(x, window_function(1024, "hann"), frame_length=1024, hop_length=160, fft_length=1024, power=1.0,
                      center=True, pad_mode="reflect", mel_filters=fb, mel_floor=1e-5, log_mel="log")  # [M, T]
    mel = torch.from_numpy(mel.T).float()[None, None].expand(1, 2, -1, -1)  # mono -> the VAE's 2 channels
    n = round(wave.numel() / 640)  # LTX2Pipeline's audio_num_frames: 25 latents a second
    with torch.no_grad():
        z = vae.encode(mel).latent_dist.mode()[:, :, :n]
    return LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(z), vae.latents_mean,
                                                 vae.latents_std)[0]


def test_cached_audio_latents_are_the_pipelines_encode_of_the_kept_frames(audio_cache, sound_clips, ltx2_audio):
    """Each clip with sound: audio_latents equal the pipeline-shaped encode of its sound cut to the
    frames the video VAE keeps (1 + 4k of F); silent films, a silent and a corrupt track: video
    only, counted in report.json."""
    from safetensors.torch import load_file

    from dit_train.data_pipelines import latent_cache as lc
    from dit_train.data_pipelines.video_dataset import VideoClipDataset

    ds = VideoClipDataset.from_manifest(sound_clips / "manifest.jsonl", patch=(1, 8, 8), max_frames=9, cache_items=0,
                                        audio=True)
    rows = [json.loads(line) for line in (audio_cache / lc.MANIFEST).read_text().splitlines()]
    assert len(rows) == len(ds)
    checked = 0
    for i, row in enumerate(rows):
        tensors = load_file(str(audio_cache / row["file"]))
        wave = ds[i].audio
        if wave is None:
            assert "audio_latents" not in tensors and "audio_len" not in row
            continue
        frames = ds[i].pixels.shape[1]
        usable = 1 + (frames - 1) // 4 * 4  # the tiny Wan VAE's 4x in time
        want = oracle_tokens(ltx2_audio, wave[: round(len(wave) * usable / frames)])
        got = tensors["audio_latents"]
        assert got.shape == want.shape == (round(usable * 2000 / 640), TOKEN_DIM) and row["audio_len"] == got.shape[0]
        assert torch.allclose(got, want, atol=2e-3, rtol=1e-3), float((got - want).abs().max())
        checked += usable < frames  # a clip whose sound was cut to the VAE's frames
    assert checked
    report = json.loads((audio_cache / lc.REPORT).read_text())
    n_audio = sum("audio_len" in r for r in rows)
    assert report["audio"] == n_audio and report["no_audio"] == len(rows) - n_audio > 2
    assert report["audio_outcomes"]["silent"] == 1 and report["audio_outcomes"]["corrupt"] == 1
    assert report["audio_outcomes"]["missing"] == len(rows) - n_audio - 2
    assert json.loads((audio_cache / lc.META).read_text())["audio"]["token_dim"] == TOKEN_DIM


def test_two_ranks_write_latent_shards_equal_to_the_one_rank_cache(audio_cache, models, sound_clips, ltx2_audio,
                                                                   tmp_path):
    """--shards --workers 2 (clips split by rank) carries every clip's audio latents and audio_len
    as the one-process cache folder has them; the shard dataset gives the same samples."""
    from dit_train.data_pipelines import latent_cache as lc
    from dit_train.tasks import build_task
    from dit_train.tools.cache_latents import main

    out = tmp_path / "shards"
    assert main(audio_cache_args(models, sound_clips, ltx2_audio, out, "--shards", "--samples-per-shard", "3",
                                 "--workers", "2")) == 0
    folder = lc.LatentCacheDataset(audio_cache, (1, 2, 2))
    cfg = compose_config(LTX2_CACHE + ["data=shards", f"data.url={out}", "data.num_workers=0"])
    shards = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed).dataset
    assert len(shards) == len(folder)
    for i in range(len(folder)):
        a, b = folder[i], shards[i]
        assert shards.audio_token_count(i) == folder.audio_token_count(i)
        assert torch.equal(a.pixels, b.pixels)
        assert (a.audio_latents is None) == (b.audio_latents is None)
        if a.audio_latents is not None:
            assert torch.equal(a.audio_latents, b.audio_latents)
    assert sum(folder.audio_token_count(i) > 0 for i in range(len(folder))) >= 2
    report = json.loads((out / lc.REPORT).read_text())
    assert report["audio"] == json.loads((audio_cache / lc.REPORT).read_text())["audio"]


LTX2_CACHE = ["model=ltx2_tiny", f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}", "model.patch_size=[1,2,2]",
              f"model.audio_patch={TOKEN_DIM}", "model.vae_scale=[4,8,8]", "train.global_batch=4"]


def test_a_pack_from_the_cache_is_the_pack_of_the_latents_given_directly(audio_cache, sound_clips, ltx2_audio):
    """The task's pack on the cache equals its pack when each clip's audio tokens are the
    pipeline-shaped encode handed over in memory: audio rows (stream 1) after each clip's video,
    noised with the clip's t; planned lengths count them."""
    from dit_train.data_pipelines.latent_cache import LatentCacheDataset
    from dit_train.data_pipelines.video_dataset import VideoClipDataset
    from dit_train.tasks import build_task

    cfg = compose_config(LTX2_CACHE + ["data=latent_cache", f"data.root={audio_cache}", "data.num_workers=0"])
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    clips = VideoClipDataset.from_manifest(sound_clips / "manifest.jsonl", patch=(1, 8, 8), max_frames=9,
                                           cache_items=0, audio=True)

    class Direct(LatentCacheDataset):  # the same video latents; audio tokens encoded here
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            wave, frames = clips[i].audio, clips[i].pixels.shape[1]
            usable = 1 + (frames - 1) // 4 * 4
            sample.audio_latents = None if wave is None else oracle_tokens(ltx2_audio, wave[: round(len(wave) * usable / frames)])
            return sample

    direct = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    direct.dataset = Direct(audio_cache, tuple(cfg.model.patch_size))
    ids = list(range(len(task.dataset)))
    a, b = task.build(ids, step=1), direct.build(ids, step=1)
    assert int((a.stream == 1).sum()) == sum(task.dataset.audio_token_count(i) for i in ids) > 0
    assert torch.equal(a.stream, b.stream) and torch.equal(a.seg, b.seg) and torch.equal(a.pos, b.pos)
    assert torch.allclose(a.tokens["x"], b.tokens["x"], atol=2e-3) and torch.allclose(a.tokens["target"], b.tokens["target"], atol=2e-3)
    video = [n - task.dataset.audio_token_count(i) for i, n in enumerate(task.lengths())]
    assert video == task.dataset.lengths()


def test_ltx2_trains_its_audio_stream_from_the_cache_and_samples_sound(audio_cache, ltx2_audio, tmp_path):
    """2 steps of model=ltx2_tiny on the cache (2 clips a step): both streams carry loss (loss/audio
    from the cached audio latents of the clips with sound). tools.sample on the run generates a
    clip's audio latents (LTX2Pipeline's count for its duration) and decodes them through the
    cache's audio VAE and vocoder into the mp4's sound."""
    from safetensors.torch import load_file

    from dit_train.__main__ import run_from_config
    from dit_train.data_pipelines.audio_latents import AudioLatentCodec
    from dit_train.tools.sample import main as sample

    cfg = compose_config(LTX2_CACHE + ["data=latent_cache", f"data.root={audio_cache}", "train.steps=2",
                                       "parallel.threads_per_worker=1", "train.global_batch=2",
                                       "train.sample_every=0"])
    cfg.run_dir = str(tmp_path / "run")
    assert run_from_config(cfg)["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss/video"] > 0 for r in rows) and any(r["loss/audio"] > 0 for r in rows), rows
    gen = tmp_path / "gen"
    assert sample([str(tmp_path / "run"), "--prompt", "a red circle", "--frames", "5", "--height", "16", "--width", "16",
                   "--steps", "2", "--out", str(gen)]) == 0
    (sound,) = load_file(gen / "sounds.safetensors").values()
    n = round(5 / 8.0 * 16000 / 640)  # 5 frames at model.fps=8: 0.625 s, 25 latents a second
    heard = AudioLatentCodec(str(ltx2_audio)).decode(torch.zeros(n, TOKEN_DIM))  # what n latents decode to
    assert sound.shape == heard.shape and float(sound.abs().max()) > 0
    assert json.loads((gen / "info.json").read_text())["sound"]["samples"] == [heard.numel()]


def test_audio_latents_a_model_cannot_read_are_refused_before_the_run(audio_cache):
    """Another model.audio_patch than the cache's token width, and the two-stream DiT (its audio
    tokens are waveform samples placed by time), each one error before step 0."""
    from dit_train.config.errors import ConfigError
    from dit_train.tasks import check_data

    cfg = compose_config(LTX2_CACHE + ["data=latent_cache", f"data.root={audio_cache}", "model.audio_patch=640"])
    with pytest.raises(ConfigError, match=f"set model.audio_patch={TOKEN_DIM}"):
        check_data(cfg)
    cfg = compose_config([f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}", "model.patch_size=[1,2,2]",
                          f"model.audio_patch={TOKEN_DIM}", "data=latent_cache", f"data.root={audio_cache}"])
    with pytest.raises(ConfigError, match="train LTX-2's audio stream"):
        check_data(cfg)
