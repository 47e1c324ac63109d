"""Reading clips: videos with decord or PyAV (video_readers.py, chosen by data.decoder), still
images with Pillow.

Probing, frame sampling by fps/stride, decoding. A still image is a clip of one frame
(`VideoInfo.frames == 1`, `fps == 0`); which reader a file gets is decided by its extension
(`is_image`), everywhere through `probe` and `read_frames`. The video reader is one per process
(`use_decoder`, called by the data source with data.decoder before it probes or reads).
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

# VideoInfo and VideoReadError are defined by the back ends (video_readers.py); the data code takes them from here
from dit_train.data_pipelines.video_readers import VideoInfo, VideoReadError, reader, resolve

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")


_decoder = "auto"  # data.decoder of this process (use_decoder); "auto" until a source sets it


def use_decoder(choice: str) -> str:
    """Read this process's videos with `choice` (data.decoder: auto | decord | pyav | torchcodec);
    returns the one-line note saying which reader that is and why. Raises ValueError naming
    data.decoder when the chosen reader cannot be imported here."""
    global _decoder
    name, note = resolve(choice)
    _decoder = name
    return note


def _video_reader():
    return reader(resolve(_decoder)[0])


def is_image(path: str | os.PathLike) -> bool:
    """Is `path` a still image (IMAGE_EXTENSIONS, any case)? Decides the reader and the frame rule."""
    return os.fspath(path).lower().endswith(IMAGE_EXTENSIONS)


def probe(path: str) -> VideoInfo:
    """Frame count, size and frame rate, without decoding the whole file (images: 1 frame, fps 0,
    the size from the header)."""
    if is_image(path):
        return probe_image(path)
    return _video_reader().probe(path)


def still_indices(multiple: int) -> list[int]:
    """Frame indices of a still image: its one frame, `multiple` times.

    The packed DiT patchifies [C, F, H, W] with a temporal patch pt; an image (F = 1) fills
    one temporal patch by repetition, i.e. it is the static clip of pt identical frames. The
    model stays unchanged (no special patch embedding for images) and an image costs
    (H/ph)·(W/pw) tokens, one temporal slab; its pixels cost pt times those of one frame.
    data.max_frames / frame_stride / fps do not apply (there is nothing to resample).
    """
    return [0] * multiple


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
    """Decode `indices` of `path` as uint8 [F, H, W, 3] (an image: its one frame, repeated
    len(indices) times; see still_indices); videos with this process's reader (use_decoder)."""
    if is_image(path):
        frame = read_image(path, info)
        return frame.expand(len(indices), -1, -1, -1).contiguous()
    return _video_reader().read(path, indices, info)


def to_model_range(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float [3, F, H, W] in [-1, 1]."""
    return frames.permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)


# -- still images (Pillow) --------------------------------------------------------------------

# EXIF orientation tag -> the transpose that shows the picture upright (as ImageOps.exif_transpose);
# 5..8 turn it by 90 degrees, so height and width swap
_ORIENT = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
           7: "TRANSVERSE", 8: "ROTATE_90"}


def _orientation(img) -> int:
    """EXIF orientation (1 = as stored) from what Image.open parsed. Not `img.getexif()`: for a PNG
    that decodes the whole image (its eXIf chunk may follow the pixels); probe and read both use
    this, so they agree on the size."""
    raw = img.info.get("exif")
    if not raw:
        return 1
    try:
        exif = Image.Exif()
        exif.load(raw)
        return int(exif.get(0x0112, 1) or 1)
    except Exception:  # a damaged EXIF block: the pixels are still fine, shown as stored
        return 1


def probe_image(path: str) -> VideoInfo:
    """1 frame and the (EXIF-oriented) size of an image, from its header; no pixel is decoded.

    `verify()` reads the rest of the file without decoding it (PNG: chunk checksums), so a
    truncated or damaged file is caught here, while indexing, rather than mid-training; what
    it cannot see (a truncated JPEG) fails at read time and is dropped by the task.
    """
    try:
        with Image.open(path) as img:
            w, h = img.size
            turned = _orientation(img) in (5, 6, 7, 8)
            img.verify()
    except Exception as e:  # UnidentifiedImageError, OSError, SyntaxError, DecompressionBombError...
        raise VideoReadError(f"cannot open image {path}: {e}") from e
    if turned:
        h, w = w, h
    return VideoInfo(frames=1, height=h, width=w, fps=0.0)


def read_image(path: str, info: VideoInfo) -> torch.Tensor:
    """Decode an image as uint8 [1, H, W, 3] RGB at `info`'s size.

    Turned upright by its EXIF orientation (as viewers show it; probe_image reports that size).
    Greyscale, palette, CMYK... become RGB; 16-bit greyscale is scaled to 8 bits (Pillow's
    convert would clip it to white); transparency is composited onto white (the colour under a
    fully transparent pixel is arbitrary, often black: dropping the alpha would train on it,
    e.g. a black logo on black). A size other than `info`'s (a manifest declaring another
    height/width) is resized to it, as for videos, so token counts stay exact.
    """
    try:
        with Image.open(path) as img:
            orient = _orientation(img)
            img.load()
            if orient in _ORIENT:
                img = img.transpose(getattr(Image.Transpose, _ORIENT[orient]))
            if img.mode == "I" or img.mode.startswith("I;16"):  # 16-bit PNG/TIFF greyscale: 0..65535
                img = Image.fromarray((np.asarray(img, np.float64) / 257.0).round().clip(0, 255).astype(np.uint8))
            if img.has_transparency_data:
                rgba = img.convert("RGBA")
                img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
            arr = np.array(img.convert("RGB"))  # a copy: writable, owns its memory
    except Exception as e:
        raise VideoReadError(f"cannot decode image {path}: {e}") from e
    x = torch.from_numpy(arr)[None]  # [1, H, W, 3]
    if x.shape[1:3] != (info.height, info.width):
        x = F.interpolate(x.permute(0, 3, 1, 2).float(), size=(info.height, info.width), mode="bilinear",
                          antialias=True, align_corners=False)
        x = x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    return x
