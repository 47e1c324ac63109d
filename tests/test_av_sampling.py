"""Generating sound: a two-stream DiT run (model.audio_patch, captions on) samples each clip's
video and audio jointly (tools.sample, validation), writes mp4s with an AAC track of the generated
sound, and scores it (docs/audio-video.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.families import family_run_cfg

AV = ["data.audio=true", "model.audio_patch=500", "model.prediction=velocity", "train.micro_batch_tokens=600"]
PROMPTS = ["a red circle moving up and left on a navy background", "a yellow square moving down and right on a black background"]


def _trained(tmp_path_factory, data_cache, overrides):
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.engine.worker import train

    cfg = apply_layout(family_run_cfg(overrides, data_cache), {})
    assert cfg.model.text_dim > 0  # the audio stream reads the captions too
    cfg.train.sample_every, cfg.train.num_samples, cfg.train.sample_steps = cfg.train.steps, 2, 2
    cfg.run_dir = str(tmp_path_factory.mktemp("av_run"))
    train(cfg)
    return cfg


@pytest.fixture(scope="module")
def av_run(tmp_path_factory, data_cache):
    return _trained(tmp_path_factory, data_cache, AV)


@pytest.fixture(scope="module")
def av_run_x0(tmp_path_factory, data_cache):
    """The same run predicting x̂0 (model.prediction=x0, the quickstart's: both streams' outputs
    become velocities v = (x_t − x̂0) / max(t, x0_min_t))."""
    return _trained(tmp_path_factory, data_cache, [o.replace("=velocity", "=x0") for o in AV])


@pytest.fixture(scope="module")
def av_run_spectrogram(tmp_path_factory, data_cache):
    """The velocity run with log-magnitude STFT audio tokens (model.audio_features=spectrogram)."""
    return _trained(tmp_path_factory, data_cache, AV + ["model.audio_features=spectrogram"])


def _track(path):
    """(codec, sample rate, seconds, decoded 16 kHz samples) of an mp4's audio stream."""
    import av

    from dit_train.data_pipelines.audio_io import decode_audio

    with av.open(str(path)) as c:
        assert len(c.streams.audio) == 1, path
        s = c.streams.audio[0]
        codec, rate, seconds = s.codec_context.name, s.rate, float(s.duration * s.time_base)
    return codec, rate, seconds, decode_audio(path, 16000)[0]


def test_samples_are_mp4s_with_the_generated_sound(av_run, tmp_path):
    """tools.sample: each prompt's mp4 has an AAC track, 16 kHz, as long as its frames (8 at 8
    fps: 1 s), holding the generated sound (sounds.safetensors); the sound figures are scored.
    Validation's mp4s carry their sound too."""
    from dit_train.tools.sample import main

    out = tmp_path / "s"
    args = [av_run.run_dir, *(a for p in PROMPTS for a in ("--prompt", p)), "--frames", "8", "--height", "32",
            "--width", "32", "--steps", "2", "--guidance", "2", "--out", str(out)]
    assert main(args) == 0
    sounds = load_file(str(out / "sounds.safetensors"))
    info = json.loads((out / "info.json").read_text())
    assert sorted(sounds) == ["prompt_0_0", "prompt_1_0"] and info["sound"]["samples"] == [16000, 16000]
    assert {"eval/sound_color_ok", "eval/sound_sync_ok", "eval/sound_all_ok"} <= set(info["scores"])
    for key, wave in sounds.items():
        codec, rate, seconds, decoded = _track(out / f"{key}.mp4")
        assert codec == "aac" and rate == 16000 and seconds == pytest.approx(1.0, abs=0.07), (codec, rate, seconds)
        # AAC is lossy and delays by its priming: the track's loudness is the generated sound's
        clipped = wave.clamp(-1, 1).numpy()
        assert np.sqrt(np.mean(decoded ** 2)) == pytest.approx(np.sqrt(np.mean(clipped ** 2)), rel=0.2)
    validation = sorted(Path(av_run.run_dir).glob("samples/step_*/*.mp4"))
    assert len(validation) == 2 and all(_track(clip)[0] == "aac" for clip in validation)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp_ulysses=2", "cp_ring=2"])
def test_sound_sampled_with_context_parallelism_matches_one_process(av_run, tmp_path, layout):
    """Two CP workers generate the same pictures and sound as one process: three clips of 128
    video and 32 audio tokens (no guidance: one copy each), so the split at token 240 cuts the
    second clip, its first 80 video tokens on rank 0, the rest and all its audio on rank 1."""
    from dit_train.tools.sample import main

    def sample(out, *extra):
        prompts = [*PROMPTS, "a white circle moving up and right on a black background"]
        args = [av_run.run_dir, *(a for p in prompts for a in ("--prompt", p)), "--frames", "8", "--height", "32",
                "--width", "64", "--steps", "2", "--guidance", "1", "--out", str(out), *extra]
        assert main(args) == 0
        return load_file(str(out / "samples.safetensors")), load_file(str(out / "sounds.safetensors"))

    one, two = sample(tmp_path / "one"), sample(tmp_path / "two", "--layout", layout)
    for a, b in zip(one, two):
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-4)


def _clip_alone(model, video, sound, t, context, patch, pt, x0_min_t=0.0, audio_patch=500):
    """The model's (video, audio) velocity of one clip packed alone, by hand: its video tokens,
    then its audio tokens (stream 1, positions (its first sample's time in temporal patches, 0, 0)
    at 8 fps: 4 tokens a frame of audio_patch samples). x0_min_t > 0: the model predicts x̂0, v = (x_t − x̂0) / max(t, x0_min_t)."""
    from dit_train.kernels import VarlenLayout
    from dit_train.tasks.video import patchify

    tok, pos = patchify(video, patch)
    n, P = sound.shape
    width = max(tok.shape[1], P)
    x = torch.cat([torch.nn.functional.pad(tok, (0, width - tok.shape[1])), torch.nn.functional.pad(sound, (0, width - P))])
    apos = torch.stack([torch.arange(n) * (audio_patch * 8 / 16000 / pt), torch.zeros(n), torch.zeros(n)], 1)
    L = x.shape[0]
    seg, order = torch.zeros(L, dtype=torch.long), torch.arange(L)
    stream = torch.cat([torch.zeros(tok.shape[0], dtype=torch.long), torch.ones(n, dtype=torch.long)])
    out = model(x, torch.cat([pos.float(), apos]), seg, torch.tensor([t]), VarlenLayout.build(seg, order, False),
                context=context[None], context_len=torch.tensor([context.shape[0]]), stream=stream)
    v, a = out[: tok.shape[0], : tok.shape[1]], out[tok.shape[0]:, :P]
    if x0_min_t:
        v, a = (tok - v) / max(t, x0_min_t), (sound - a) / max(t, x0_min_t)
    return v, a


@pytest.mark.parametrize("prediction", ["velocity", "x0", "spectrogram"])
def test_generated_sound_equals_a_hand_run_sampler_loop(request, prediction):
    """Two clips of different sizes sampled together with guidance 2 (VideoSampler, one pack
    holding both clips' video and audio, captioned and not) equal, video and audio values, an
    Euler loop run by hand on each clip alone: noise from the "sampling" / "audio_sampling"
    streams, sigmas 1 -> 0, v = v_u + g (v_c - v_u) on both streams, x += (σ' − σ) v.
    "spectrogram" (velocity, model.audio_features=spectrogram): the tokens are 4 STFT frames of
    257 bins, and the sound is their Griffin-Lim decoding."""
    from dit_train.data_pipelines.audio_features import decode, token_width
    from diffusers import FlowMatchEulerDiscreteScheduler

    from dit_train.checkpoint.export import run_weights
    from dit_train.models import build_model
    from dit_train.models.init import load_full_weights
    from dit_train.parallel.mesh import init_parallel
    from dit_train.rng import sample_generator
    from dit_train.sampling import VideoSampler
    from dit_train.sampling.prompts import prompt_requests, prompt_space
    from dit_train.tasks.video import unpatchify
    from dit_train.tasks.video_inputs import video_inputs

    cfg = request.getfixturevalue({"velocity": "av_run", "x0": "av_run_x0"}.get(prediction, "av_run_spectrogram"))
    features = str(cfg.model.audio_features)
    assert cfg.model.prediction == prediction or features == prediction
    model = build_model(cfg.model)
    load_full_weights(model, run_weights(Path(cfg.run_dir), None)[0])
    model.eval()
    space = prompt_space(cfg)
    requests = prompt_requests(space, PROMPTS[:1], 1, 8, 32, 32) + prompt_requests(space, PROMPTS[1:], 1, 4, 32, 64)
    requests[1].noise_id = 5
    steps, g, seed, P = 3, 2.0, 0, cfg.model.audio_patch
    sampler = VideoSampler(requests, video_inputs(cfg.model, cfg.cond), space.null, init_parallel(cfg.parallel), steps, g,
                           seed)
    clips = sampler.sample(model)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    sched.set_timesteps(steps)
    sigmas = sched.sigmas.tolist()
    patch, pt = tuple(cfg.model.patch_size), cfg.model.patch_size[0]
    for k, r in enumerate(requests):
        x = torch.randn(r.shape, generator=sample_generator(seed, r.noise_id, 0, "sampling"))
        a = torch.randn((r.shape[1] * 2000 // P, token_width(P, features)),
                        generator=sample_generator(seed, r.noise_id, 0, "audio_sampling"))
        heard = False
        with torch.no_grad():
            for i in range(steps):
                min_t = cfg.model.x0_min_t if prediction == "x0" else 0.0
                vc, ac = _clip_alone(model, x, a, sigmas[i], r.context, patch, pt, min_t, P)
                vu, au = _clip_alone(model, x, a, sigmas[i], space.null, patch, pt, min_t, P)
                v = unpatchify(vu + g * (vc - vu), tuple(n // p for n, p in zip(r.shape[1:], patch)), patch, 3)
                x = x + (sigmas[i + 1] - sigmas[i]) * v
                a = a + (sigmas[i + 1] - sigmas[i]) * (au + g * (ac - au))
                heard |= not torch.allclose(ac, au, atol=1e-6)  # the audio stream reads the caption
        assert sampler.sounds[k].shape == (r.shape[1] * 2000,)
        assert torch.allclose(clips[k], x, atol=1e-5), (clips[k] - x).abs().max()
        assert a.shape[1] == (4 * 257 if features == "spectrogram" else P)
        sound = decode(a, P, features)  # the samples, or Griffin-Lim from the STFT magnitudes
        # Griffin-Lim's 48 iterations carry the tokens' float rounding (1e-6) up to ~5e-5 of a 0.2-RMS sound
        tol = 1e-5 if features == "wave" else 5e-4
        assert torch.allclose(sampler.sounds[k], sound, atol=tol), (sampler.sounds[k] - sound).abs().max()
        assert heard and a.abs().max() > 0.1  # not vacuous: captions reach the sound, which moved from its noise


def test_what_does_not_take_sound_yet_is_refused_in_one_line(av_run, tmp_path, capsys):
    """Distilling a run with an audio stream, and video_rl on it (rollouts whose sound no reward
    reads), are refused before anything is built, in one line naming the audio stream."""
    from dit_train.config.errors import ConfigError
    from dit_train.distill.build import student_config
    from dit_train.tools.video_rl import main
    from tests.conftest import TINY, compose_config

    c = compose_config([*TINY, "+experiment=distill_dmd2", f"distill.teacher={av_run.run_dir}"],
                       cache_dir=av_run.data.cache_dir)
    with pytest.raises(ConfigError, match=r"an audio stream \(model.audio_patch=500\)"):
        student_config(c)
    assert main([av_run.run_dir, "--steps", "1", "--out", str(tmp_path / "rl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "audio stream (model.audio_patch=500)" in err[0], err
    assert not (tmp_path / "rl").exists()


def test_evaluate_reports_the_sound_figures_of_a_two_stream_run(av_run, tmp_path):
    """tools.evaluate --heldout on a two-stream run: evaluate.json has the sound figures of the
    generated sound beside the picture's, over the held-out captions."""
    from dit_train.tools.evaluate import main

    out = tmp_path / "eval"
    assert main([av_run.run_dir, "--heldout", "--n", "3", "--steps", "1", "--out", str(out)]) == 0
    scores = json.loads((out / "evaluate.json").read_text())["scores"]
    assert {"all_ok", "sound_color_ok", "sound_sync_ok", "sound_all_ok"} <= set(scores)
    assert scores["sound_num_clips"] == 3


def test_the_sync_probe_reads_a_planted_signal_and_not_noise():
    """tools.probe_sync's ridge probe, fitted on the even clips and scored on the odd ones, finds
    a label written into one feature and reads chance from noise (fitted and scored on the same
    rows it would read ~0.9 from this noise: seen failing so)."""
    import numpy as np

    from dit_train.tools.probe_sync import auc, probe

    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(240, 60)), rng.integers(0, 2, 240)
    clips = np.repeat(np.arange(60), 4)
    assert 0.35 < probe(X, y, clips) < 0.65
    X[:, 7] += 5 * y
    assert probe(X, y, clips) > 0.9


def test_the_click_gain_is_one_for_the_click_and_zero_for_the_tone():
    """tools.probe_sync's teacher-forced click gain: an x̂0 equal to x0 has gain 1 and no error; one
    that puts the clip's steady token (its median: the tone) everywhere has gain 0 and its whole
    error at the click tokens; half the click, 0.5."""
    from dit_train.tools.probe_sync import click_gain

    torch.manual_seed(0)
    tone = torch.randn(1, 20)
    x0 = tone + 0.01 * torch.randn(12, 20)
    clicks = torch.zeros(12, dtype=torch.bool)
    clicks[[3, 8]] = True
    x0[clicks] += 2.0 * torch.randn(2, 20)
    along, energy, err_click, err_other = click_gain(x0, x0.clone(), clicks)
    assert sum(along) / sum(energy) == pytest.approx(1.0) and max(err_click + err_other) == 0
    m = x0.median(0).values
    along, energy, err_click, err_other = click_gain(x0, m.expand(12, 20), clicks)
    assert sum(along) / sum(energy) == pytest.approx(0.0, abs=1e-6) and min(err_click) > 100 * max(err_other)
    along, energy, _, _ = click_gain(x0, (m + x0) / 2, clicks)
    assert sum(along) / sum(energy) == pytest.approx(0.5)


def test_the_place_gains_split_each_place_into_click_and_other_tokens():
    """tools.probe_sync's per-place table: the mean at each place's click tokens and at its other
    tokens, with their counts (a place without a click reads nan there)."""
    import math

    from dit_train.tools.probe_sync import place_gains

    along = torch.tensor([0.9, 0.1, 0.0, 0.2, 0.7, 0.3, 0.0, 0.1])
    places = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    clicks = torch.tensor([True, False, False, False, False, False, False, False])
    rows = place_gains(along, places, clicks)
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert rows[0][1:] == (pytest.approx(0.9), 1, pytest.approx(0.7), 1)
    assert math.isnan(rows[1][1]) and rows[1][2] == 0 and rows[1][3:] == (pytest.approx(0.2), 2)


def test_the_sync_probe_runs_on_a_two_stream_run(av_run_spectrogram, capsys):
    """`python -m dit_train.tools.probe_sync RUN`: one AUC per block for each probe, over the
    clips with sound asked for (a run without a sound stream is refused)."""
    import math

    from dit_train.tools.probe_sync import main, probe_run

    cfg = av_run_spectrogram
    r = probe_run(cfg.run_dir, clips=12)
    assert r["clips"] >= 12 and r["bounces"] > 0 and r["clicks"] > 0 and r["tokens"] > r["clicks"]
    assert len(r["video"]) == len(r["audio"]) == cfg.model.depth
    assert all(0 <= v <= 1 for v in r["video"] + r["audio"] if not math.isnan(v))
    assert math.isfinite(r["click_gain"]) and r["error_click"] >= 0 and r["error_other"] >= 0
    # every place of a patch is listed (500-sample tokens, 2-frame patches at 8 fps: 8), clicks at
    # a frame's first token only (places 0 and 4)
    places = r["places"]
    assert [p[0] for p in places] == list(range(8)) and sum(p[2] + p[4] for p in places) == r["tokens"]
    assert {p[0] for p in places if p[2]} <= {0, 4} and sum(p[2] for p in places) == r["clicks"]
    main([str(cfg.run_dir), "--clips", "8", "--t", "0.5"])
    out = capsys.readouterr().out
    assert "| 0 |" in out and "click gain" in out and "per place in the temporal patch" in out
