"""What an audio token of the two-stream DiT holds (model.audio_features), and back to sound.

- `wave`: the token's `audio_patch` 16 kHz waveform samples themselves.
- `spectrogram`: the log-magnitude STFT frames of those samples — FRAMES = audio_patch / HOP
  frames of N_FFT // 2 + 1 bins each, frame-major: [n, FRAMES · BINS]. Phase-free: a steady tone
  is a steady band, a bounce's click a burst in one token, so the loss no longer asks for the
  tone's phase at every sample (which, measured on the embedded world, is 98-99 % of the
  waveform tokens' error at high noise: docs/audio-video.md). Decoded with Griffin-Lim.

The STFT runs over a clip's whole track (frames centred on multiples of HOP, the last one, past
the track's end, dropped), so token k holds the frames centred in its own samples. Nothing here
communicates.
"""
from __future__ import annotations

import torch

# 512-sample windows (32 ms at 16 kHz): 31 Hz bins, so the world's tones (220-1109 Hz, a major
# third apart) fall on distinct bins; hop 125 (7.8 ms) puts 4 whole frames in a 500-sample token
# and resolves a ~12 ms click in time to one token
N_FFT = 512
HOP = 125
BINS = N_FFT // 2 + 1
# log(|X| + LOG_FLOOR), then (· - LOG_SHIFT) / LOG_SCALE: fixed constants, never statistics of the
# data, so every run and the sampler read the same scale (on the embedded world's sound: mean
# -0.08, std 0.88; silence at -0.4, a tone's peak at +5)
LOG_FLOOR = 1e-2
LOG_SHIFT = -4.0
LOG_SCALE = 1.5
GRIFFIN_LIM_ITERS = 48
GRIFFIN_LIM_MOMENTUM = 0.99


def token_width(audio_patch: int, features: str) -> int:
    """Features of one audio token: audio_patch (`wave`) or FRAMES · BINS (`spectrogram`); 0 for
    audio_patch 0 (a video-only model)."""
    return audio_patch if str(features) == "wave" else audio_patch // HOP * BINS


def feature_errors(audio_patch: int, features: str) -> list[str]:
    """Why `audio_patch` cannot carry `features` (config check), or []."""
    if str(features) == "spectrogram" and (audio_patch <= 0 or audio_patch % HOP):
        return [f"model.audio_features=spectrogram needs model.audio_patch a positive multiple of the STFT hop "
                f"{HOP} (whole frames per token: 500 = 4 frames), not {audio_patch}"]
    return []


def _window() -> torch.Tensor:
    return torch.hann_window(N_FFT, dtype=torch.float32)


def encode(wave: torch.Tensor, audio_patch: int, features: str) -> torch.Tensor:
    """float32 [N] waveform -> [N // audio_patch, token_width] tokens (the tail under one token
    dropped); the waveform's samples, or their normalised log-magnitude STFT frames."""
    n = wave.numel() // audio_patch
    wave = wave[: n * audio_patch].float()
    if str(features) == "wave":
        return wave.reshape(n, audio_patch)
    if n == 0:
        return torch.zeros(0, token_width(audio_patch, features))
    spec = torch.stft(wave, N_FFT, HOP, window=_window(), center=True, pad_mode="constant", return_complex=True)
    frames = spec.abs().T[: n * audio_patch // HOP]  # [n · FRAMES, BINS]: the frame past the end dropped
    return ((frames + LOG_FLOOR).log() - LOG_SHIFT).div(LOG_SCALE).reshape(n, -1)


def decode(tokens: torch.Tensor, audio_patch: int, features: str) -> torch.Tensor:
    """[n, token_width] tokens -> float32 [n · audio_patch] waveform: the samples themselves, or a
    Griffin-Lim estimate from the magnitudes (fast Griffin-Lim: Perraudin et al. 2013, the momentum
    torchaudio's GriffinLim uses). Written here on torch.stft / torch.istft because torchaudio has
    no build beside this torch and scipy / librosa are not dependencies."""
    tokens = tokens.float()
    if str(features) == "wave":
        return tokens.reshape(-1)
    length = tokens.shape[0] * audio_patch
    if length == 0:
        return torch.zeros(0)
    mag = (tokens.reshape(-1, BINS) * LOG_SCALE + LOG_SHIFT).exp().sub(LOG_FLOOR).clamp_min(0)
    mag = torch.cat([mag, mag[-1:]]).T  # [BINS, frames + 1]: stand-in for the dropped last frame
    window = _window()
    gen = torch.Generator().manual_seed(0)  # a fixed start: decoding is a function of the tokens
    angles = torch.polar(torch.ones_like(mag), 2 * torch.pi * torch.rand(mag.shape, generator=gen))
    previous = torch.zeros_like(angles)
    for _ in range(GRIFFIN_LIM_ITERS):
        wave = torch.istft(mag * angles, N_FFT, HOP, window=window, center=True, length=length)
        rebuilt = torch.stft(wave, N_FFT, HOP, window=window, center=True, pad_mode="constant", return_complex=True)
        angles = rebuilt - GRIFFIN_LIM_MOMENTUM / (1 + GRIFFIN_LIM_MOMENTUM) * previous
        angles = angles / angles.abs().clamp_min(1e-16)
        previous = rebuilt
    return torch.istft(mag * angles, N_FFT, HOP, window=window, center=True, length=length)
