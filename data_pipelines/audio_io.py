"""Reading a clip's sound (`data.audio=true`): PyAV decodes, resamples and downmixes; this module
only cuts the span of the frames a clip keeps and says what it had to do.

Every outcome of bad input is a value, never an exception midway through a run:

| outcome   | when                                               | the sample gets            |
|-----------|----------------------------------------------------|----------------------------|
| ok        | the track covers the span at the wanted rate       | the span                   |
| resampled | another sample rate (or several channels)          | the span, resampled (PyAV) |
| trimmed   | the track runs past the end of the video           | the span (the rest cut)    |
| short     | the track ends before the span does                | what there is (fewer T_{b,audio}) |
| silent    | nothing above SILENCE in the span                  | no audio (video stream only) |
| corrupt   | the file or its audio stream cannot be decoded     | no audio                   |
| missing   | no audio stream / no file                          | no audio                   |

The dataset counts outcomes per clip read (`VideoClipDataset.audio_outcomes`): a clip without
audio stays in the video stream and is simply not in B_audio (docs/audio-video.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the rate every clip's sound is read at: diffusers' AutoencoderKLLTX2Audio default (mel hop 160 ->
# 100 mel frames a second); at the embedded world's 8 fps, 2000 samples a frame
SAMPLE_RATE = 16000
SILENCE = 1e-4  # peak |x| under which a track counts as silent (16-bit PCM's step is 3e-5)
# a track longer than the video by more than this many seconds counts as `trimmed`: encoders pad
# the last audio frame (an AAC frame is 1024 samples, 64 ms at 16 kHz), which is no bad input
TRIM_TOLERANCE_S = 0.1


@dataclass
class AudioRead:
    """samples: float32 [N] mono in [-1, 1] at the wanted rate, or None (no usable audio);
    outcomes: what reading it took (module docstring), e.g. ("resampled", "trimmed")."""

    samples: np.ndarray | None
    outcomes: tuple[str, ...] = field(default_factory=tuple)


def decode_audio(path: str | Path, rate: int) -> tuple[np.ndarray, int, int]:
    """(float32 [N] mono at `rate`, the stream's own rate, its channels) of the first audio
    stream of `path` (wav, mp4, ...): PyAV's AudioResampler converts format, layout and rate.
    Raises LookupError without an audio stream, av.FFmpegError (an OSError/ValueError) when
    decoding fails."""
    import av  # deferred: PyAV loads FFmpeg (~1 s)

    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise LookupError("no audio stream")
        stream = container.streams.audio[0]
        native, channels = int(stream.rate or 0), int(stream.channels or 0)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        parts = []
        for frame in container.decode(stream):
            parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return (np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)), native, channels


def read_audio(path: str | Path, rate: int, start_s: float, stop_s: float, video_s: float) -> AudioRead:
    """The sound of [start_s, stop_s) of a clip whose video lasts `video_s` seconds, at `rate`.
    Never raises for bad input: see the module docstring's outcomes."""
    if not path or not Path(path).exists():
        return AudioRead(None, ("missing",))
    try:
        x, native, channels = decode_audio(path, rate)
    except LookupError:
        return AudioRead(None, ("missing",))
    except (OSError, ValueError, RuntimeError, EOFError):  # av.FFmpegError and friends
        return AudioRead(None, ("corrupt",))
    outcomes = []
    if native != rate or channels > 1:
        outcomes.append("resampled")
    if len(x) > round((video_s + TRIM_TOLERANCE_S) * rate):
        outcomes.append("trimmed")
    a, b = round(start_s * rate), round(stop_s * rate)
    span = x[a:b]
    if len(span) < b - a:
        outcomes.append("short")
    if not len(span) or float(np.abs(span).max()) < SILENCE:
        return AudioRead(None, ("silent",))
    return AudioRead(np.ascontiguousarray(span), tuple(outcomes) or ("ok",))


def resample(wave: np.ndarray, rate: int, to: int) -> np.ndarray:
    """float32 [N] mono at `rate` -> float32 [M] at `to` (PyAV's AudioResampler; as is when equal)."""
    if rate == to:
        return wave.astype(np.float32)
    import av  # deferred: PyAV loads FFmpeg (~1 s)

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave, np.float32)[None], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to)
    parts = [f.to_ndarray().reshape(-1) for f in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
