"""The given stream of cross-stream sampling (a run trained with cond.given_stream:
docs/audio-video.md): `tools.sample RUN --prompt ... --video clip.mp4` generates the sound of the
clip's frames (video-to-audio), `--audio sound.wav` the frames of a sound (audio-to-video).

The files are read with the data's own readers (data_pipelines/video_io.py, audio_io.py) and
checked before any worker starts (ValueError: one `error:` line naming the flag): a video must
have the run's frame rate (the sound is generated on the time axis training aligned to it) and at
least --frames frames, of which the first --frames are given, resized to cover --height x
--width and centre-cropped as the data's buckets are; a sound is resampled to 16 kHz mono by
PyAV, must cover the --frames' span, and is cut to it in whole audio tokens. One file per
--prompt (in order), or one for all of them.

Nothing here communicates.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dit_train.data_pipelines.audio_io import SAMPLE_RATE, SILENCE, decode_audio
from dit_train.data_pipelines.sizes import resize_crop
from dit_train.data_pipelines.video_io import is_image, probe, read_frames, to_model_range, VideoReadError
from dit_train.sampling.sampler import SampleRequest
from dit_train.sampling.sound import sound_tokens
from dit_train.tasks.joint_audio import audio_tokens

FPS_TOLERANCE = 0.01  # relative: a 7.99 fps file is the run's 8 fps (container rates are rationals)


def check_flags(cond: Any, videos: list[str], audios: list[str], prompts: list[str], data_captions: int) -> None:
    """ValueError (naming the flag and the override that trains it) when --video / --audio do not
    fit the run: --audio without cond.given_stream=audio, --video for sound on a run without
    cond.given_stream=video (--video on a cond.kind=prefix run is that run's, not checked here),
    with --data-captions, or neither one file nor one per --prompt."""
    if audios and not cond.gives_audio:
        raise ValueError(f"--audio gives a clip's sound to generate its frames (audio-to-video): this run trained "
                         f"cond.given_stream={cond.given_stream}; train with cond.given_stream=audio")
    if not cond.cross_stream:
        return
    if videos and not cond.gives_video:
        raise ValueError(f"--video gives a clip's frames to generate its sound (video-to-audio): this run trained "
                         f"cond.given_stream={cond.given_stream}; train with cond.given_stream=video")
    files = videos or audios
    if files and data_captions:
        raise ValueError("--data-captions samples the run's clips jointly; --video / --audio go with --prompt")
    if files and len(files) not in (1, len(prompts)):
        flag = "--video" if videos else "--audio"
        raise ValueError(f"{len(files)} {flag} files for {len(prompts)} --prompt: give one for all, or one per prompt")


def video_from_file(path: str, shape: tuple[int, int, int, int], fps: float) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1]: the first F frames of the video at `path`, resized to cover H x W
    and centre-cropped; ValueError for a still image, another frame rate, or fewer frames."""
    C, F, H, W = shape
    if C != 3:
        raise ValueError("--video gives pixels: it needs a pixel-space run (data=synthetic_video or video_folder)")
    if not Path(path).is_file():
        raise ValueError(f"--video {path}: no such file")
    if is_image(path):
        raise ValueError(f"--video {path} is a still image: video-to-audio needs the clip's frames")
    try:
        info = probe(path)
        if abs(info.fps - fps) > FPS_TOLERANCE * fps:
            raise ValueError(f"--video {path} runs at {info.fps:g} fps, the run at {fps:g}: the sound is made on the "
                             f"run's time axis; re-encode the clip at {fps:g} fps")
        if info.frames < F:
            raise ValueError(f"--video {path} has {info.frames} frames; --frames {F} needs at least that many")
        pixels = to_model_range(read_frames(path, list(range(F)), info))
    except VideoReadError as err:
        raise ValueError(f"--video {path}: {err}") from None
    return resize_crop(pixels.contiguous(), H, W, resize=True)


def sound_from_file(path: str, shape: tuple[int, int, int, int], fps: float, audio_patch: int,
                    features: str = "wave") -> torch.Tensor:
    """[n, W] the first n = sound_tokens(F, fps) audio tokens (model.audio_features) of the sound at `path`
    (16 kHz mono, PyAV resampling); ValueError when it cannot be decoded, is silent, or is shorter."""
    n = sound_tokens(shape[1], fps, audio_patch)
    if not Path(path).is_file():
        raise ValueError(f"--audio {path}: no such file")
    try:
        wave, _, _ = decode_audio(path, SAMPLE_RATE)
    except LookupError:
        raise ValueError(f"--audio {path} has no audio stream") from None
    except (OSError, ValueError, RuntimeError, EOFError) as err:  # av.FFmpegError and friends
        raise ValueError(f"--audio {path} cannot be decoded ({type(err).__name__}: {err})") from None
    need = n * audio_patch
    if len(wave) < need:
        raise ValueError(f"--audio {path} holds {len(wave) / SAMPLE_RATE:.2f} s of sound; --frames {shape[1]} at "
                         f"{fps:g} fps needs {need / SAMPLE_RATE:.2f} s")
    span = torch.from_numpy(wave[:need].copy())
    if float(span.abs().max()) < SILENCE:
        raise ValueError(f"--audio {path} is silent over the first {need / SAMPLE_RATE:.2f} s")
    return audio_tokens(span, audio_patch, features)


def give_streams(requests: list[SampleRequest], videos: list[str], audios: list[str], num: int,
                 audio_patch: int, features: str = "wave") -> None:
    """Set each prompt request's given stream from the files (one for all, or one per prompt;
    `num` requests per prompt, in prompt order)."""
    files = videos or audios
    for i, r in enumerate(requests):
        path = files[0] if len(files) == 1 else files[i // num]
        if videos:
            r.given_video = video_from_file(path, r.shape, r.fps)
        else:
            r.given_sound = sound_from_file(path, r.shape, r.fps, audio_patch, features)
