"""Cross-stream sampling: a two-stream DiT run trained with cond.given_stream generates the sound
of a given video (video-to-audio) or the frames of a given sound (audio-to-video): the given
stream's tokens are clean context at t = 0 in every pack, as training gives them, and come back
unchanged (docs/audio-video.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.test_av_sampling import AV, PROMPTS, _trained

CLIP = (8, 32, 32)  # frames, height, width of the given clips


@pytest.fixture(scope="module")
def v2a_run(tmp_path_factory, data_cache):
    """A tiny two-stream run trained video-to-audio half the time (cond.given_stream=video)."""
    # init=normal: adaLN-zero would leave t (and so the clean flags) without effect after two steps
    return _trained(tmp_path_factory, data_cache, [*AV, "cond.given_stream=video", "model.init=normal"])


def _clip_file(path, k=0, fps=8, frames=CLIP[0]):
    """A rendered clip of PROMPTS[0]'s composition as an H.264 mp4; returns its path."""
    from dit_train.data_pipelines.synthetic_video import render_long_clip, write_mp4

    write_mp4(path, render_long_clip(PROMPTS[0], frames, CLIP[1], CLIP[2], index=k), fps=fps)
    return path


def _hand_run(model, r, patch, P, steps, g, null, given, g_audio):
    """The joint sampler's loop run by hand on clip r alone, one stream given clean: each call
    packs its video tokens then its audio tokens, the given stream's flagged clean (t = 0), and
    only the other stream takes the Euler steps x += (σ' − σ)·(v_u + g·(v_c − v_u))."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from dit_train.kernels import VarlenLayout
    from dit_train.rng import sample_generator
    from dit_train.tasks.video import patchify, unpatchify

    x = r.given_video if given == "video" else torch.randn(r.shape, generator=sample_generator(0, r.noise_id, 0, "sampling"))
    a = r.given_sound if given == "audio" else torch.randn((r.shape[1] * 2000 // P, P),
                                                            generator=sample_generator(0, r.noise_id, 0, "audio_sampling"))
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    sched.set_timesteps(steps)
    sig = sched.sigmas.tolist()

    def call(x, a, t, ctx):
        tok, pos = patchify(x, patch)
        n = a.shape[0]
        width = max(tok.shape[1], P)
        inp = torch.cat([torch.nn.functional.pad(tok, (0, width - tok.shape[1])), torch.nn.functional.pad(a, (0, width - P))])
        apos = torch.stack([torch.arange(n) * (P * 8 / 16000 / patch[0]), torch.zeros(n), torch.zeros(n)], 1)
        L = inp.shape[0]
        seg = torch.zeros(L, dtype=torch.long)
        stream = torch.cat([torch.zeros(tok.shape[0], dtype=torch.long), torch.ones(n, dtype=torch.long)])
        clean = stream == (0 if given == "video" else 1)
        out = model(inp, torch.cat([pos.float(), apos]), seg, torch.tensor([t]), VarlenLayout.build(seg, torch.arange(L), False),
                    context=ctx[None], context_len=torch.tensor([ctx.shape[0]]), clean=clean, stream=stream)
        return out[: tok.shape[0], : tok.shape[1]], out[tok.shape[0]:, :P]

    with torch.no_grad():
        for i in range(steps):
            vc, ac = call(x, a, sig[i], r.context)
            vu, au = call(x, a, sig[i], null)
            if given == "video":
                a = a + (sig[i + 1] - sig[i]) * (au + g_audio * (ac - au))
            else:
                grid = tuple(n // p for n, p in zip(r.shape[1:], patch))
                x = x + (sig[i + 1] - sig[i]) * unpatchify(vu + g * (vc - vu), grid, patch, 3)
    return x, a


@pytest.mark.parametrize("given", ["video", "audio"])
def test_a_given_stream_comes_back_unchanged_and_the_other_is_the_hand_run_loop(v2a_run, tmp_path, given):
    """VideoSampler with one stream given (guidance 2, two clips in one pack, one given and one
    joint): the given stream comes back bit for bit, the generated one equals the Euler loop run
    by hand with the given stream clean at t = 0, and it depends on what was given; the clip
    without a given stream is what the joint sampler alone makes of it."""
    from dit_train.checkpoint.export import run_weights
    from dit_train.data_pipelines.synthetic_video import render_long_clip
    from dit_train.models import build_model
    from dit_train.models.init import load_full_weights
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling import VideoSampler
    from dit_train.sampling.prompts import prompt_requests, prompt_space
    from dit_train.tasks.video_inputs import video_inputs

    cfg = v2a_run
    P = cfg.model.audio_patch
    model = build_model(cfg.model)
    load_full_weights(model, run_weights(Path(cfg.run_dir), None)[0])
    model.eval()
    space = prompt_space(cfg)
    inputs, ctx = video_inputs(cfg.model, cfg.cond), init_parallel(cfg.parallel)

    def requests(k):
        rs = prompt_requests(space, PROMPTS, 1, *CLIP)
        clip = torch.from_numpy(render_long_clip(PROMPTS[0], *CLIP, index=k)).permute(3, 0, 1, 2).float() / 127.5 - 1
        if given == "video":
            rs[0].given_video = clip
        else:
            t = torch.arange(CLIP[0] * 2000) / 16000
            rs[0].given_sound = (0.25 * torch.sin(2 * torch.pi * (220 + 200 * k) * t)).reshape(-1, P)
        return rs

    calls = []

    class Recording(torch.nn.Module):  # what the sampler feeds the model: the clean flags per call
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *args, **kw):
            calls.append((args[2], kw.get("clean"), kw["stream"]))
            return self.inner(*args, **kw)

    def sample(rs):  # the sound guided at 3, the pictures at 2 (LTX2Pipeline's audio_guidance_scale)
        s = VideoSampler(rs, inputs, space.null, ctx, 3, 2.0, 0, audio_guidance_scale=3.0)
        return s.sample(Recording()), s.sounds

    rs = requests(0)
    clips, sounds = sample(rs)
    # every call (3 steps, each clip with and without its caption: segs 0, 1 captioned, 2, 3 not) flags
    # exactly clip 0's given stream clean, in both guidance branches
    assert len(calls) == 3
    for seg, clean, stream in calls:
        assert torch.equal(clean, (stream == ("video", "audio").index(given)) & (seg % 2 == 0))
    out = {"video": clips[0], "audio": sounds[0].reshape(-1, P)}
    kept = rs[0].given_video if given == "video" else rs[0].given_sound
    assert torch.equal(out[given], kept)  # bit for bit
    x, a = _hand_run(model, rs[0], tuple(cfg.model.patch_size), P, 3, 2.0, space.null, given, 3.0)
    made = out["audio" if given == "video" else "video"]
    hand = a if given == "video" else x
    assert torch.allclose(made, hand, atol=1e-5), (made - hand).abs().max()
    alone = prompt_requests(space, PROMPTS[1:], 1, *CLIP)  # the other clip alone, with its noise
    alone[0].noise_id = rs[1].noise_id
    joint_clips, joint_sounds = sample(alone)
    torch.testing.assert_close(clips[1], joint_clips[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(sounds[1], joint_sounds[0], atol=1e-5, rtol=0)
    clips2, sounds2 = sample(requests(1))  # another given stream, the same noise: another result
    other = sounds2[0] if given == "video" else clips2[0]
    assert (other.reshape(made.shape) - made).abs().max() > 1e-5  # a tiny run: small, but never 0 when it reaches the pack


def test_tools_sample_writes_the_sound_of_a_given_video(v2a_run, tmp_path):
    """tools.sample --video on a cond.given_stream=video run: the clip's frames come back as they
    were read (samples.safetensors equals the decoded file), its mp4 carries the generated sound
    (AAC, 1 s for 8 frames at 8 fps), info.json names the given file; without --video the run
    samples jointly."""
    from dit_train.data_pipelines.video_io import probe, read_frames, to_model_range
    from dit_train.tools.sample import main
    from tests.test_av_sampling import _track

    clip = _clip_file(tmp_path / "clip.mp4")
    out = tmp_path / "s"
    size = ["--frames", "8", "--height", "32", "--width", "32", "--steps", "2", "--guidance", "2"]
    assert main([v2a_run.run_dir, "--prompt", PROMPTS[0], "--video", str(clip), *size, "--out", str(out)]) == 0
    pixels, sounds = load_file(str(out / "samples.safetensors")), load_file(str(out / "sounds.safetensors"))
    decoded = to_model_range(read_frames(str(clip), list(range(8)), probe(str(clip))))
    assert torch.equal(pixels["prompt_0_0"], decoded)
    codec, rate, seconds, _ = _track(out / "prompt_0_0.mp4")
    assert codec == "aac" and seconds == pytest.approx(1.0, abs=0.07) and sounds["prompt_0_0"].shape == (16000,)
    info = json.loads((out / "info.json").read_text())
    assert info["given_stream"] == {"video": [str(clip)], "audio": []}
    assert main([v2a_run.run_dir, "--prompt", PROMPTS[0], *size, "--out", str(tmp_path / "joint")]) == 0
    joint = load_file(str(tmp_path / "joint" / "samples.safetensors"))["prompt_0_0"]
    assert not torch.equal(joint, decoded)


def test_given_streams_that_do_not_fit_are_refused_in_one_line(v2a_run, tmp_path, capsys):
    """Before any worker: --audio on a video-to-audio run (names cond.given_stream=audio), a clip
    at another frame rate, one with too few frames, two clips for one prompt, a silent or short
    sound file (read by the same reader on an audio-to-video config)."""
    from dit_train.sampling.cross_stream import sound_from_file
    from dit_train.data_pipelines.synthetic_video import write_wav
    from dit_train.tools.sample import main

    clip = _clip_file(tmp_path / "clip.mp4")
    size = ["--frames", "8", "--height", "32", "--width", "32", "--steps", "1", "--out", str(tmp_path / "no")]
    cases = [(["--audio", str(clip)], "train with cond.given_stream=audio"),
             (["--video", str(_clip_file(tmp_path / "fast.mp4", fps=24))], "runs at 24 fps, the run at 8"),
             (["--video", str(_clip_file(tmp_path / "short.mp4", frames=4))], "has 4 frames; --frames 8"),
             (["--video", str(clip), "--video", str(clip)], "2 --video files for 1 --prompt"),
             (["--audio-guidance", "0.5"], "--audio-guidance=0.5 guides a run's sound")]
    for extra, needle in cases:
        assert main([v2a_run.run_dir, "--prompt", PROMPTS[0], *extra, *size]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (needle, err)
    assert not (tmp_path / "no").exists()
    write_wav(tmp_path / "silent.wav", np.zeros(16000, dtype=np.float32))
    write_wav(tmp_path / "short.wav", np.full(8000, 0.3, dtype=np.float32))
    for name, needle in (("silent.wav", "is silent"), ("short.wav", "holds 0.50 s of sound")):
        with pytest.raises(ValueError, match=needle):
            sound_from_file(str(tmp_path / name), (3, 8, 32, 32), 8.0, 500)


def test_evaluate_scores_video_to_audio_on_rendered_heldout_clips(v2a_run, tmp_path):
    """tools.evaluate --given-video: each held-out caption gets a rendered clip of its composition
    (OUT/given/), the clip comes back as given, and evaluate.json has the sound figures."""
    from dit_train.tools.evaluate import main

    out = tmp_path / "eval"
    assert main([v2a_run.run_dir, "--heldout", "--given-video", "--n", "2", "--steps", "1", "--audio-guidance", "3",
                 "--out", str(out)]) == 0
    row = json.loads((out / "evaluate.json").read_text())
    assert row["given_video"] and row["scores"]["sound_num_clips"] == 2 and sorted(p.name for p in (out / "given").iterdir()) == [
        "clip_0000.mp4", "clip_0001.mp4"]
    info = json.loads((out / "info.json").read_text())
    assert info["audio_guidance_scale"] == row["audio_guidance"] == 3.0  # passed on to tools.sample
    assert info["given_stream"]["video"] == [str(out / "given" / f"clip_{k:04d}.mp4") for k in range(2)]
    assert main([v2a_run.run_dir, "--train-captions", "--given-video", "--out", str(tmp_path / "no")]) == 2
