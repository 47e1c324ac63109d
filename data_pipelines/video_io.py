"""Reading video with decord: probing, frame sampling by fps/stride, decoding a clip."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


class VideoReadError(RuntimeError):
    """A file that cannot be opened or decoded (corrupt, truncated, not a video)."""


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    height: int
    width: int
    fps: float


def _reader(path: str, **kw):
    import decord

    try:
        return decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1, **kw)
    except Exception as e:  # decord raises its own DECORDError / RuntimeError types
        raise VideoReadError(f"cannot open video {path}: {e}") from e


def probe(path: str) -> VideoInfo:
    """Frame count, size and frame rate, without decoding the whole file."""
    vr = _reader(path)
    n = len(vr)
    if n == 0:
        raise VideoReadError(f"video {path} has no frames")
    h, w = _native_size(vr, path)
    return VideoInfo(frames=n, height=h, width=w, fps=float(vr.get_avg_fps() or 0.0))


def _native_size(vr, path: str) -> tuple[int, int]:
    try:
        shape = vr[0].shape  # decodes one frame
    except Exception as e:
        raise VideoReadError(f"cannot decode the first frame of {path}: {e}") from e
    return int(shape[0]), int(shape[1])


def frame_indices(total: int, native_fps: float, target_fps: float, stride: int, max_frames: int, multiple: int = 1) -> list[int]:
    """Indices of the frames to keep.

    Resample to `target_fps` (0 = native), take every `stride`-th frame, keep at most
    `max_frames` from the start, then drop the tail so the count is a multiple of `multiple`
    (the temporal patch). Empty if the clip is too short for one temporal patch.
    """
    step = float(stride)
    if target_fps > 0 and native_fps > 0:
        step *= native_fps / target_fps
    count = int(math.floor((total - 1) / step)) + 1 if total > 0 else 0
    count = min(count, max_frames) if max_frames > 0 else count
    count -= count % multiple
    return [min(total - 1, int(round(i * step))) for i in range(count)]


def read_frames(path: str, indices: list[int], info: VideoInfo) -> torch.Tensor:
    """Decode `indices` of `path` as uint8 [F, H, W, 3].

    decord 0.6 returns garbled frames (4 or 6 "channels") for some widths (e.g. 48, 72): the
    row stride of its output buffer is wrong. We then decode at the next width that is a
    multiple of 32, which it handles, and resize back to the native width.
    """
    vr = _reader(path)
    try:
        arr = vr.get_batch(indices).asnumpy()
    except Exception:
        arr = None
    if arr is None or arr.shape[1:] != (info.height, info.width, 3):
        safe_w = int(math.ceil(info.width / 32) * 32)
        vr = _reader(path, width=safe_w, height=info.height)
        try:
            arr = vr.get_batch(indices).asnumpy()
        except Exception as e:
            raise VideoReadError(f"cannot decode frames of {path}: {e}") from e
        x = torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2).float()
        x = F.interpolate(x, size=(info.height, info.width), mode="bilinear", antialias=True, align_corners=False)
        return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    return torch.from_numpy(np.ascontiguousarray(arr))


def to_model_range(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float [3, F, H, W] in [-1, 1]."""
    return frames.permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)
