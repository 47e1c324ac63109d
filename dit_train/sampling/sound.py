"""Generating each clip's sound with its pictures (a model with an audio stream: model.audio_patch > 0).

The sampler (sampler.py) packs every clip's audio tokens right after its video tokens, as training
does (tasks/joint_audio.py), and runs the same steps on both: the clip's own noise level, its own
scheduler per stream, the same guidance (the audio tokens of the uncaptioned copy are the
guidance's negative too). What is generated per clip is `sound_tokens` tokens of `audio_patch`
16 kHz waveform samples, the span of its frames: float32 [N] mono, what tools.sample and
validation write as the mp4s' AAC tracks and what the sound metric scores. The starting noise of
a clip's sound is the "audio_sampling" stream of (seed, noise id): a two-stream model's pictures
start from the noise a video-only model's would.

Nothing here communicates.
"""
from __future__ import annotations

from typing import Any

import torch

from dit_train.data_pipelines.audio_io import SAMPLE_RATE
from dit_train.data_pipelines.shapes_metric import parse_caption
from dit_train.data_pipelines.shapes_sound_metric import bounce_frames, score_sounds
from dit_train.rng import sample_generator


def sound_tokens(frames: int, fps: float, audio_patch: int) -> int:
    """Audio tokens of a clip of `frames` frames at `fps`: its span's 16 kHz samples in whole
    tokens (as training cuts a clip's track: the tail under one token dropped)."""
    return int(round(frames * SAMPLE_RATE / fps)) // audio_patch


def start_sound(shape: tuple[int, ...], fps: float, audio_patch: int, seed: int, noise_id: int,
                latent: Any = None, width: int = 0) -> torch.Tensor:
    """[n, width or audio_patch] starting noise of a clip's sound (shape (C, F, H, W), F frames at
    fps; width: an audio token's features, model.audio_features); `latent` (DataSource.sound:
    cached audio latents) says n for a latent clip instead."""
    n = latent.tokens(shape) if latent is not None else sound_tokens(shape[1], fps, audio_patch)
    return torch.randn((n, width or audio_patch), generator=sample_generator(seed, noise_id, 0, "audio_sampling"))


def sound_noise(seed: int, noise_id: int, step: int) -> torch.Generator:
    """The generator of a clip's sound's stochastic re-noising at sampler step `step` (the same
    (seed, id, step) rule as its pictures', on the audio stream)."""
    return sample_generator(seed, noise_id, step, "audio_sampling")


def sound_scores(captions: list[str], pixels: list[torch.Tensor], sounds: list[torch.Tensor] | None) -> dict[str, float]:
    """The sound figures (data_pipelines/shapes_sound_metric.py) of generated clips against their
    captions and the bounces seen in their own generated pixels ([3, F, H, W] in [-1, 1]): {}
    without sound or when no caption is one of the shapes world's (the others are skipped,
    eval/sound_num_clips counts the scored ones)."""
    keep = [k for k, c in enumerate(captions) if parse_caption(c) is not None] if sounds else []
    if not keep:
        return {}
    return score_sounds([sounds[k].float().numpy() for k in keep], [captions[k] for k in keep],
                        [bounce_frames(pixels[k].float().clamp(-1, 1)) for k in keep])


def sound_info(sounds: list[torch.Tensor] | None) -> dict[str, Any]:
    """What info.json says of the generated sound (empty without any)."""
    if sounds is None:
        return {}
    return {"sound": {"sample_rate": SAMPLE_RATE, "samples": [int(s.numel()) for s in sounds]}}
