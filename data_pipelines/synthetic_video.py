"""The embedded dataset: small mp4 clips of moving coloured shapes, generated on first use.

Clips differ in duration and resolution on purpose: the loss weighting only matters when
samples differ in token count. Everything is a pure function of (gen_seed, clip index), so
every machine writes the same pixels. The set is written into a temporary directory and
renamed into place, so concurrent writers (several ranks, several jobs) never see half a set.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

# Default sizes and frame range (inclusive) of a clip; `data.widths`, `data.heights` and
# `data.frames` choose others. Widths are multiples of 32: decord 0.6 returns garbled frames for
# some other widths (see data_pipelines/video_io.py); heights are free.
WIDTHS = (32, 64, 96)
HEIGHTS = (32, 48, 64)
FRAMES = (4, 24)
FPS = 8
COLORS = {
    "red": (230, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230), "yellow": (240, 220, 40),
    "white": (245, 245, 245), "purple": (150, 60, 200), "orange": (250, 140, 30), "cyan": (40, 210, 220),
}
BACKGROUNDS = {"black": (10, 10, 10), "gray": (110, 110, 110), "navy": (20, 20, 70), "olive": (80, 90, 30)}
SHAPES = ("circle", "square")


def _render(rng: np.random.Generator, widths: Sequence[int] = WIDTHS, heights: Sequence[int] = HEIGHTS,
            frames: Sequence[int] = FRAMES) -> tuple[np.ndarray, str]:
    """One clip as uint8 [F, H, W, 3] and its caption; W, H drawn from `widths`, `heights`,
    F from frames[0]..frames[1] (inclusive)."""
    W, H = int(rng.choice(list(widths))), int(rng.choice(list(heights)))
    F = int(rng.integers(frames[0], frames[1] + 1))
    bg_name = str(rng.choice(list(BACKGROUNDS)))
    color_name = str(rng.choice(list(COLORS)))
    shape = str(rng.choice(SHAPES))
    r = float(rng.uniform(0.12, 0.25)) * min(H, W)
    x, y = float(rng.uniform(r, W - r)), float(rng.uniform(r, H - r))
    speed = float(rng.uniform(1.0, 3.0))
    angle = float(rng.uniform(0, 2 * np.pi))
    vx, vy = speed * np.cos(angle), speed * np.sin(angle)
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    frames = np.empty((F, H, W, 3), np.uint8)
    for f in range(F):
        img = np.empty((H, W, 3), np.uint8)
        img[:] = BACKGROUNDS[bg_name]
        if shape == "circle":
            inside = (xx - x) ** 2 + (yy - y) ** 2 <= r * r
        else:
            inside = (np.abs(xx - x) <= r) & (np.abs(yy - y) <= r)
        img[inside] = COLORS[color_name]
        frames[f] = img
        x, y = x + vx, y + vy
        if not r <= x <= W - r:  # bounce off the walls
            vx, x = -vx, float(np.clip(x, r, W - r))
        if not r <= y <= H - r:
            vy, y = -vy, float(np.clip(y, r, H - r))
    horiz = "right" if vx > 0 else "left"
    vert = "down" if vy > 0 else "up"
    caption = f"a {color_name} {shape} moving {vert} and {horiz} on a {bg_name} background"
    return frames, caption


def write_mp4(path: Path, frames: np.ndarray, fps: int = FPS) -> None:
    """Encode uint8 [F, H, W, 3] as H.264 mp4 (PyAV / libx264, near-lossless)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "12", "preset": "veryfast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _sizes(widths: Sequence[int], heights: Sequence[int], frames: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    w, h, f = tuple(int(x) for x in widths), tuple(int(x) for x in heights), tuple(int(x) for x in frames)
    if not w or not h or any(x % 32 or x <= 0 for x in w):
        raise ValueError(f"synthetic video widths {list(w)} must be positive multiples of 32 (decord), heights {list(h)} non-empty")
    if any(x < 8 for x in h):
        raise ValueError(f"synthetic video heights {list(h)} must be >= 8")
    if len(f) != 2 or not 1 <= f[0] <= f[1]:
        raise ValueError(f"synthetic video frames {list(f)} must be [min, max] with 1 <= min <= max")
    return w, h, f


def dataset_dir(cache_dir: str | os.PathLike, num_clips: int, gen_seed: int, widths: Sequence[int] = WIDTHS,
                heights: Sequence[int] = HEIGHTS, frames: Sequence[int] = FRAMES) -> Path:
    """The set's directory; sizes other than the defaults get their own name."""
    w, h, f = _sizes(widths, heights, frames)
    name = f"synthetic_video_v1_n{num_clips}_seed{gen_seed}"
    if (w, h, f) != (WIDTHS, HEIGHTS, FRAMES):
        name += "_w" + "-".join(map(str, w)) + "_h" + "-".join(map(str, h)) + "_f" + "-".join(map(str, f))
    return Path(cache_dir).expanduser() / name


def ensure_synthetic_videos(cache_dir: str | os.PathLike, num_clips: int, gen_seed: int, widths: Sequence[int] = WIDTHS,
                            heights: Sequence[int] = HEIGHTS, frames: Sequence[int] = FRAMES) -> Path:
    """Write the clip set if it is not there yet; return its directory (holding manifest.jsonl)."""
    out = dataset_dir(cache_dir, num_clips, gen_seed, widths, heights, frames)
    if (out / "manifest.jsonl").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        lines = []
        for i in range(num_clips):
            clip, caption = _render(np.random.default_rng([gen_seed, i]), widths, heights, frames)
            name = f"clip_{i:04d}.mp4"
            write_mp4(tmp / name, clip)
            lines.append(json.dumps({"path": name, "caption": caption, "frames": int(clip.shape[0]),
                                     "height": int(clip.shape[1]), "width": int(clip.shape[2]), "fps": FPS}))
        (tmp / "manifest.jsonl").write_text("\n".join(lines) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "manifest.jsonl").exists():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
