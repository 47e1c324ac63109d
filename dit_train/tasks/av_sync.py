"""The sync feature of a two-stream DiT's audio tokens (`model.sync_encoder`, docs/audio-video.md).

A frame is an instant: the sound of what happens in frame f starts at its time f / fps. The sync
encoder (models/sync_encoder.py) gives each frame of a *clean* picture the probability p_f that a
sound event starts there; the audio token whose span of samples holds the frame's instant gets
p_f (the largest, when several frames' instants fall in one token), every other token 0. The
tokens carry it as the per-token field tokens["sync"] [L] float32 (0 on video tokens), packed and
split by CP like every token field, and the DiT adds its own embedding of sync · model.sync_scale
to the audio token's (models/dit.py).

Only a clean picture has a sync feature: the given video of video-to-audio training
(cond.given_stream=video) and sampling (a given clip, or the pictures a joint sampling made first:
sampling/sampler.py). A clip whose picture is being generated gets zeros.

Nothing here communicates.
"""
from __future__ import annotations

import torch

from dit_train.data_pipelines.audio_io import SAMPLE_RATE
from dit_train.models import sync_encoder


@torch.no_grad()
def frame_probs(path: str, pixels: torch.Tensor) -> torch.Tensor:
    """[F] float32 in [0, 1]: the encoder at `path` on pixels [3, F, H, W] (in [-1, 1])."""
    return torch.sigmoid(sync_encoder.load(path)(pixels.float())).float()


def sync_tokens(probs: torch.Tensor, n: int, audio_patch: int, fps: float) -> torch.Tensor:
    """[n] float32: each frame's probability probs [F] on the audio token (of `audio_patch` samples
    at 16 kHz) whose span holds the frame's instant f / fps; 0 elsewhere (and on no token past n)."""
    out = torch.zeros(n)
    if n == 0 or fps <= 0:
        return out
    start = torch.arange(probs.shape[0], dtype=torch.float64) * (SAMPLE_RATE / fps)  # the frame's first sample
    token = torch.floor(start / audio_patch + 1e-9).long()
    inside = token < n
    return out.scatter_reduce(0, token[inside], probs[inside].float(), reduce="amax")


def clip_sync(path: str, pixels: torch.Tensor | None, n: int, audio_patch: int, fps: float) -> torch.Tensor:
    """[n] the sync feature of a clip's n audio tokens from its clean pixels [3, F, H, W] (None:
    its picture is not given, zeros)."""
    if pixels is None or not path:
        return torch.zeros(n)
    return sync_tokens(frame_probs(path, pixels), n, audio_patch, fps)
