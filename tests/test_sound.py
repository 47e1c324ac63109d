"""The embedded world's sound (data.audio): rendering, the sound metric, reading audio with its
bad-input outcomes, and the dataset's waveforms (docs/audio-video.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dit_train.data_pipelines.audio_io import read_audio
from dit_train.data_pipelines.shapes_sound_metric import click_frames, color_of_pitch, pitch_of, score_sound
from dit_train.data_pipelines.synthetic_video import PITCHES, SAMPLE_RATE, SAMPLES_PER_FRAME, render_sound, write_wav
from dit_train.data_pipelines.synthetic_video import COLORS, _render, ensure_synthetic_videos

CAPTION = "a {} circle moving up and left on a black background"


@pytest.mark.parametrize("color", list(COLORS))
def test_rendered_sound_states_its_colour_and_bounces(color):
    wave = render_sound(color, [3, 9], 12)
    assert wave.shape == (12 * SAMPLES_PER_FRAME,) and wave.dtype == np.float32
    assert color_of_pitch(pitch_of(wave)) == color
    assert click_frames(wave) == [3, 9]
    assert score_sound(wave, CAPTION.format(color), [3, 9])["sound_all_ok"] == 1.0
    assert score_sound(wave, CAPTION.format(color), [4, 8])["sound_sync_ok"] == 1.0  # within one frame


def test_the_sound_metric_fails_what_is_wrong():
    wave = render_sound("red", [3, 9], 12)
    wrong_colour = score_sound(wave, CAPTION.format("green"), [3, 9])
    assert wrong_colour["sound_color_ok"] == 0.0 and wrong_colour["sound_sync_ok"] == 1.0
    assert score_sound(wave, CAPTION.format("red"), [3, 6, 9])["sound_sync_ok"] == 0.0  # a bounce without a click
    assert score_sound(wave, CAPTION.format("red"), [9])["sound_sync_ok"] == 0.0  # a click without a bounce
    assert score_sound(wave, CAPTION.format("red"), [1, 9])["sound_sync_ok"] == 0.0  # two frames late
    noise = np.random.default_rng(0).normal(0, 0.3, wave.shape).astype(np.float32)
    assert score_sound(noise, CAPTION.format("red"), [3, 9])["sound_all_ok"] == 0.0


def test_silence_passes_sync_only_where_nothing_bounces():
    """A tone without clicks passes sound_sync_ok on a clip that never bounces: sound_sync_bounced
    scores the clips that do bounce apart, so silence against still pictures is not synchrony."""
    from dit_train.data_pipelines.shapes_sound_metric import score_sounds

    tone = render_sound("red", [], 12)
    s = score_sounds([tone, tone, render_sound("red", [4], 12)], [CAPTION.format("red")] * 3, [[], [4], [4]])
    assert s["eval/sound_sync_ok"] == pytest.approx(2 / 3)
    assert (s["eval/sound_sync_bounced"], s["eval/sound_bounced_clips"]) == (0.5, 2.0)
    assert s["eval/sound_clicking_clips"] == 1.0  # only the third clip's sound clicks


def test_sound_changes_no_pixel_and_lists_the_bounces():
    """The renderer draws the same pixels when asked for the bounces, and the bounces it lists
    are, within a frame, those seen on its (lossless) pixels."""
    from dit_train.data_pipelines.shapes_sound_metric import _matched, bounce_frames

    listed = 0
    for i in range(12):
        plain, cap = _render(np.random.default_rng([7, i]))
        bounces: list[int] = []
        with_sound, cap2 = _render(np.random.default_rng([7, i]), bounces=bounces)
        assert cap == cap2 and np.array_equal(plain, with_sound)
        seen = bounce_frames(plain)
        assert _matched(bounces, seen) and _matched(seen, bounces), (i, bounces, seen)
        listed += len(bounces)
    assert listed >= 5


def test_reading_audio_resamples_trims_and_counts_bad_tracks(tmp_path):
    wave = render_sound("blue", [2], 10)
    seconds = 10 / 8
    write_wav(tmp_path / "ok.wav", wave)
    got = read_audio(tmp_path / "ok.wav", SAMPLE_RATE, 0.0, seconds, seconds)
    assert got.outcomes == ("ok",) and np.abs(got.samples - wave).max() < 1e-4
    write_wav(tmp_path / "stereo8k.wav", np.stack([wave[::2], wave[::2]], 1), rate=8000)  # another rate, 2 channels
    got = read_audio(tmp_path / "stereo8k.wav", SAMPLE_RATE, 0.0, seconds, seconds)
    assert got.outcomes == ("resampled",) and len(got.samples) == len(wave)
    assert color_of_pitch(pitch_of(got.samples)) == "blue"
    got = read_audio(tmp_path / "ok.wav", SAMPLE_RATE, 0.25, 0.75, 0.75)  # the track outlasts the video
    assert got.outcomes == ("trimmed",) and len(got.samples) == SAMPLE_RATE // 2
    got = read_audio(tmp_path / "ok.wav", SAMPLE_RATE, 1.0, 2.0, 2.0)  # a short track
    assert got.outcomes == ("short",) and len(got.samples) == round(0.25 * SAMPLE_RATE)
    write_wav(tmp_path / "silent.wav", wave * 0)
    assert read_audio(tmp_path / "silent.wav", SAMPLE_RATE, 0.0, seconds, seconds).outcomes == ("silent",)
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(64))
    assert read_audio(tmp_path / "corrupt.wav", SAMPLE_RATE, 0.0, seconds, seconds).outcomes == ("corrupt",)
    assert read_audio(tmp_path / "absent.wav", SAMPLE_RATE, 0.0, seconds, seconds).outcomes == ("missing",)


def test_dataset_gives_each_clip_its_sound_and_counts_the_rest(tmp_path):
    """data.audio: clips with sound get the span of their kept frames (2000 samples a frame),
    silent films None; a clip without an audio stream (the mp4s) is counted `missing`."""
    from dit_train.data_pipelines.video_dataset import VideoClipDataset

    root = ensure_synthetic_videos(tmp_path, 8, 3, frames=(4, 10), audio=True)
    rows = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    assert 0 < sum("audio" in r for r in rows) < len(rows)  # some clips are silent films
    ds = VideoClipDataset.from_manifest(root / "manifest.jsonl", patch=(1, 8, 8), max_frames=6, cache_items=0,
                                        audio=True)
    for i, row in enumerate(rows):
        sample = ds[i]
        if "audio" in row:
            assert sample.audio is not None and sample.audio.shape == (ds.frames(i) * SAMPLES_PER_FRAME,)
            assert color_of_pitch(pitch_of(sample.audio.numpy())) == row["caption"].split()[1]
        else:
            assert sample.audio is None
    n_sound = sum("audio" in r for r in rows)
    assert any(r["frames"] > 6 for r in rows if "audio" in r)  # cut to the kept frames: no bad input
    assert dict(ds.audio_outcomes) == {"ok": n_sound, "missing": len(rows) - n_sound}


def test_training_refuses_data_audio_before_the_run():
    from dit_train.compose import compose
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    with pytest.raises(ConfigError, match="data.audio=true: model=dit has no audio stream"):
        check_config(compose(["data.audio=true"]))


def test_reference_sound_scores_of_the_embedded_set(tmp_path):
    """What a perfect generator scores: the set's own sound against the bounces found on its own
    decoded pixels (the colour always; the clicks within one frame of a bounce on most clips)."""
    from dit_train.data_pipelines.shapes_sound_metric import reference_sound_scores

    root = ensure_synthetic_videos(tmp_path, 16, 1234, heldout_compositions=True, audio=True)
    exact = reference_sound_scores(root, from_pixels=False)
    assert exact["eval/sound_all_ok"] == 1.0 and exact["eval/sound_num_clips"] >= 10
    seen = reference_sound_scores(root, from_pixels=True)
    assert seen["eval/sound_color_ok"] == 1.0 and seen["eval/sound_sync_ok"] >= 0.8, seen


def _mux(path, frames: np.ndarray, sound: np.ndarray, rate: int, layout: str) -> None:
    """An mp4 with H.264 video at 8 fps and an AAC audio stream of `sound` (16 kHz) resampled to
    `rate`, `layout` mono or stereo: a real video's own soundtrack."""
    import av

    with av.open(str(path), "w") as c:
        v = c.add_stream("libx264", rate=8)
        v.width, v.height, v.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        a = c.add_stream("aac", rate=rate)
        a.layout = layout
        for fr in frames:
            for p in v.encode(av.VideoFrame.from_ndarray(fr, format="rgb24")):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        x = np.interp(np.arange(len(sound) * rate // SAMPLE_RATE) * SAMPLE_RATE / rate, np.arange(len(sound)), sound)
        x = np.repeat(x[None].astype(np.float32), 1 if layout == "mono" else 2, 0)
        for i in range(0, x.shape[1], 1024):
            af = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[:, i:i + 1024]), format="fltp", layout=layout)
            af.sample_rate, af.pts = rate, i
            for p in a.encode(af):
                c.mux(p)
        for p in a.encode():
            c.mux(p)


def test_a_videos_own_soundtrack_is_read_resampled_and_cut_to_the_kept_frames(tmp_path):
    """Without an `audio` column the clip's own audio stream is read (AAC in mp4): 16 kHz mono
    as it is, 48 kHz stereo resampled; the sound of the kept frames still names the colour and
    clicks at the bounce."""
    from dit_train.data_pipelines.video_dataset import VideoClipDataset

    frames, caption = _render(np.random.default_rng([1, 2]))
    color = caption.split()[1]
    sound = render_sound(color, [3], len(frames))
    rows = []
    for name, rate, layout in (("mono16k.mp4", 16000, "mono"), ("stereo48k.mp4", 48000, "stereo")):
        _mux(tmp_path / name, frames, sound, rate, layout)
        rows.append(json.dumps({"path": name, "caption": caption}))
    (tmp_path / "manifest.jsonl").write_text("\n".join(rows) + "\n")
    ds = VideoClipDataset.from_manifest(tmp_path / "manifest.jsonl", patch=(1, 8, 8), max_frames=8, cache_items=0,
                                        audio=True)
    for i in range(2):
        got = ds[i].audio.numpy()
        assert got.shape == (8 * SAMPLES_PER_FRAME,)
        assert color_of_pitch(pitch_of(got)) == color and click_frames(got) == [3]
    assert dict(ds.audio_outcomes) == {"ok": 1, "resampled": 1}


def test_spectrogram_tokens_decode_to_their_pitch_and_clicks():
    """model.audio_features=spectrogram: a world clip's sound -> log-magnitude STFT tokens (as many
    as waveform tokens, features of order 1) -> Griffin-Lim back to a waveform: the sound metric
    scores the decoded sound as it scores the clip's own (every colour's pitch, every click in its
    frame, none elsewhere); `wave` tokens are the samples themselves."""
    import torch

    from dit_train.data_pipelines.audio_features import decode, encode, token_width

    for k, color in enumerate(COLORS):
        bounces = [[0, 5], [3], [], [2, 7]][k % 4]
        wave = torch.from_numpy(render_sound(color, bounces, 8))
        assert torch.equal(decode(encode(wave, 500, "wave"), 500, "wave"), wave)
        tokens = encode(wave, 500, "spectrogram")
        assert tokens.shape == (32, token_width(500, "spectrogram")) == (32, 4 * 257)
        assert tokens.abs().max() < 6 and tokens.std() < 1.5
        back = decode(tokens, 500, "spectrogram").numpy()
        assert back.shape == wave.shape and click_frames(back) == bounces, (color, click_frames(back))
        reference = score_sound(wave.numpy(), CAPTION.format(color), bounces)
        assert score_sound(back, CAPTION.format(color), bounces) == reference == {
            "sound_color_ok": 1.0, "sound_sync_ok": 1.0, "sound_all_ok": 1.0}
