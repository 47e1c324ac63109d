"""What a sampling writes, and how a person looks at it.

    <out>/samples.safetensors   the clips as floats in [-1, 1], [3, F, H, W], keyed `sample_<id>`
                                (dataset clips) or `prompt_<k>` (prompts)
    <out>/captions.json         {key: caption}
    <out>/<key>.mp4             one video per clip at the data's frame rate (with the clip's
                                generated sound as an AAC track, 16 kHz mono, for a model with
                                an audio stream)
    <out>/sounds.safetensors    that sound as floats [N] per key (a model with an audio stream)
    <out>/grid.png              a row per clip (its caption above it), frames left to right
    <out>/info.json             which weights, step, sampler settings, and the quality figures
Trackers (optional, dit_train/trackers): the grid as the image `samples/grid` and each clip
(its mp4 when one was written) as the video `samples/<key>`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from dit_train.data_pipelines.audio_io import SAMPLE_RATE
from dit_train.data_pipelines.synthetic_video import write_mp4
from dit_train.sampling.sampler import SampleRequest
from dit_train.trackers.base import Clip


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


def write_samples(out_dir: Path, requests: list[SampleRequest], pixels: list[torch.Tensor], info: dict | None = None,
                  trackers: Any = None, step: int = 0, max_videos: int = 0,
                  sounds: list[torch.Tensor] | None = None) -> Path:
    """Write every output listed in the module docstring; `max_videos` > 0 caps the mp4 count and
    the clips given to the trackers (the safetensors and the grid always hold every clip).
    `trackers`: anything with `log_images` / `log_videos` (a MetricsLogger, a Tracker).
    `sounds`: each clip's generated sound, float [N] at SAMPLE_RATE (None: silent mp4s)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({r.key: p.contiguous() for r, p in zip(requests, pixels)}, str(out_dir / "samples.safetensors"))
    if sounds is not None:
        save_file({r.key: a.float().contiguous() for r, a in zip(requests, sounds)}, str(out_dir / "sounds.safetensors"))
    (out_dir / "captions.json").write_text(json.dumps({r.key: r.caption for r in requests}, indent=2))
    (out_dir / "info.json").write_text(json.dumps(info or {}, indent=2))
    frames = [to_uint8_frames(p) for p in pixels]
    clips = {}
    for k, (r, f) in enumerate(zip(requests, frames)):
        if max_videos and k >= max_videos:
            break
        sound = sounds[k].float().numpy() if sounds is not None else None
        write_mp4(out_dir / f"{r.key}.mp4", _even(f), fps=max(1, round(r.fps)), sound=sound, rate=SAMPLE_RATE)
        clips[f"samples/{r.key}"] = Clip(f, r.fps, r.caption, out_dir / f"{r.key}.mp4")
    grid = frame_grid(frames, [r.caption for r in requests])
    Image.fromarray(grid).save(out_dir / "grid.png")
    if trackers is not None:
        trackers.log_images({"samples/grid": grid}, step)
        trackers.log_videos(clips, step)
    return out_dir
