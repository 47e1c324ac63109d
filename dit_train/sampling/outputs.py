"""What a sampling writes, and how a person looks at it.

    <out>/samples.safetensors   the clips as floats in [-1, 1], [3, F, H, W], keyed `sample_<id>`
                                (dataset clips) or `prompt_<k>` (prompts)
    <out>/captions.json         {key: caption}
    <out>/<key>.mp4             one video per clip at the data's frame rate
    <out>/grid.png              a row per clip (its caption above it), frames left to right
    <out>/info.json             which weights, step, sampler settings, and the quality figures
TensorBoard (optional): the grid as an image and each clip as an animated GIF.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dit_train.sampling.sampler import SampleRequest


def to_pixels(clips: list[torch.Tensor], decode: Callable[[torch.Tensor], torch.Tensor] | None) -> list[torch.Tensor]:
    """Model-space clips -> pixels [3, F, H, W] in [-1, 1] (latents go through the VAE decoder)."""
    return [(decode(c) if decode else c).float().clamp(-1, 1) for c in clips]


def scored_view(requests: list[SampleRequest], pixels: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a quality metric should see: a still image as its one frame (the others repeat it)."""
    return [p[:, :1] if r.still else p for r, p in zip(requests, pixels)]


def to_uint8_frames(pixels: torch.Tensor) -> np.ndarray:
    """[3, F, H, W] in [-1, 1] -> uint8 [F, H, W, 3]."""
    return ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0).numpy()


def _even(frames: np.ndarray) -> np.ndarray:
    """H.264 with yuv420p wants even sizes: pad odd ones by one edge row/column."""
    F, H, W, _ = frames.shape
    return np.pad(frames, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)), mode="edge")


def frame_grid(clips: list[np.ndarray], captions: list[str] | None = None, max_cols: int = 8, gap: int = 2) -> np.ndarray:
    """uint8 [F_i, H_i, W_i, 3] clips -> one image: a row per clip (up to max_cols evenly spaced
    frames), each row under a strip with its caption."""
    from PIL import Image, ImageDraw

    cells = [[c[j] for j in np.linspace(0, len(c) - 1, min(max_cols, len(c))).round().astype(int)] for c in clips]
    ch = max(f.shape[0] for row in cells for f in row)
    cw = max(f.shape[1] for row in cells for f in row)
    cols = max(len(r) for r in cells)
    text_h = 12 if captions else 0
    row_h = text_h + ch + gap
    width = max(cols * (cw + gap) + gap, 6 * max((len(c) for c in captions), default=0) + 2 * gap if captions else 0)
    img = np.full((len(cells) * row_h + gap, width, 3), 255, dtype=np.uint8)
    for i, row in enumerate(cells):
        for j, f in enumerate(row):
            y, x = gap + i * row_h + text_h, gap + j * (cw + gap)
            img[y:y + f.shape[0], x:x + f.shape[1]] = f
    if not captions:
        return img
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    for i, text in enumerate(captions):
        draw.text((gap, gap + i * row_h), text, fill=(0, 0, 0))  # PIL's built-in bitmap font
    return np.asarray(pil)


def gif_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 [F, H, W, 3] -> an animated GIF."""
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=int(1000 / max(fps, 1)), loop=0)
    return buf.getvalue()


def add_gif(tb: Any, tag: str, frames: np.ndarray, fps: float, step: int) -> None:
    """An animated clip in TensorBoard's image tab, without moviepy (what add_video needs)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    F, H, W, _ = frames.shape
    image = Summary.Image(height=H, width=W, colorspace=3, encoded_image_string=gif_bytes(frames, fps))
    tb._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


def write_samples(out_dir: Path, requests: list[SampleRequest], pixels: list[torch.Tensor], info: dict | None = None,
                  tb: Any = None, step: int = 0, max_videos: int = 0) -> Path:
    """Write every output listed in the module docstring; `max_videos` > 0 caps the mp4/GIF count
    (the safetensors and the grid always hold every clip)."""
    from PIL import Image
    from safetensors.torch import save_file

    from data_pipelines.synthetic_video import write_mp4

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({r.key: p.contiguous() for r, p in zip(requests, pixels)}, str(out_dir / "samples.safetensors"))
    (out_dir / "captions.json").write_text(json.dumps({r.key: r.caption for r in requests}, indent=2))
    (out_dir / "info.json").write_text(json.dumps(info or {}, indent=2))
    frames = [to_uint8_frames(p) for p in pixels]
    for k, (r, f) in enumerate(zip(requests, frames)):
        if max_videos and k >= max_videos:
            break
        write_mp4(out_dir / f"{r.key}.mp4", _even(f), fps=max(1, round(r.fps)))
        if tb is not None:
            add_gif(tb, f"samples/{r.key}", f, r.fps, step)
    grid = frame_grid(frames, [r.caption for r in requests])
    Image.fromarray(grid).save(out_dir / "grid.png")
    if tb is not None:
        tb.add_image("samples/grid", grid, step, dataformats="HWC")
    return out_dir
