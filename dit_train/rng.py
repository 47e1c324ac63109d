"""Randomness that touches the loss, as a pure function of (seed, sample id, step).

Never of the rank, the micro-batch or the position in a pack: a different parallel layout
puts a sample elsewhere but draws the same noise, timestep and conditioning dropout for it.
Generators are CPU generators (same bits on every device); callers move results to the device.
"""
from __future__ import annotations

import hashlib

import torch

# audio_noise: the two-stream DiT's audio tokens (tasks/joint_audio.py); rollout_exit: Self-Forcing's
# exit step of each block of a sample's rollout (distill/self_forcing.py); audio_sampling: the
# generated sound's noise (sampling/sound.py), apart from "sampling" so the pictures of a two-stream
# model start from the same noise as a video-only one's
STREAMS = ("noise", "timestep", "caption_dropout", "sampling", "conditioning", "distill_student", "distill_critic",
           "audio_noise", "block_timestep", "rollout_exit", "audio_sampling")


def sample_generator(seed: int, sample_id: int, step: int, stream: str) -> torch.Generator:
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r}")
    digest = hashlib.blake2b(f"{seed}:{sample_id}:{step}:{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
