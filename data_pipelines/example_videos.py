"""A folder of example clips standing in for a user's own videos: different sizes, frame rates
and lengths, a caption .txt beside each (what `data=video_folder` reads). The quickstart of
docs/own-videos.md writes them with `python -m dit_train.tools.example_videos videos/`.

Each clip is a coloured shape crossing a flat background (the embedded world's palette,
data_pipelines/synthetic_video.py), encoded with PyAV (libx264) at its own size and rate.
With `masks` each clip gets a loss mask beside it (clip.mask.mp4: white on the shape, grey
(weight ~1/4) on a band around it, black elsewhere; data.masks=true), with `control` a control
video (clip.control.mp4: the shape's white silhouette on black; cond.control=true).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dit_train.data_pipelines.synthetic_video import _draw, write_mp4


@dataclass(frozen=True)
class ExampleClip:
    name: str  # file name (.mp4); the caption goes to <name>.txt
    height: int
    width: int
    fps: int
    frames: int
    color: str  # a synthetic_video.COLORS name
    shape: str  # circle | square
    background: str  # a synthetic_video.BACKGROUNDS name
    rightward: bool = True

    @property
    def caption(self) -> str:
        way = "right" if self.rightward else "left"
        return f"a {self.color} {self.shape} moving {way} on a {self.background} background"


# what a new user might have: a small old phone clip (QCIF, 30 fps, 3 s), a wide banner-like
# clip (25 fps, 2 s) and a 720p clip (25 fps, 1 s: shorter than 16 frames at 8 fps)
EXAMPLE_CLIPS = (
    ExampleClip("qcif_30fps.mp4", 144, 176, 30, 90, "red", "circle", "navy"),
    ExampleClip("wide_25fps.mp4", 272, 640, 25, 50, "yellow", "square", "gray", rightward=False),
    ExampleClip("hd_25fps.mp4", 720, 1280, 25, 25, "green", "circle", "black"),
)


def _path(clip: ExampleClip) -> tuple[np.ndarray, float]:
    """The shape's centre x of each frame and its half-size r (it crosses once, edge to edge)."""
    H, W, F = clip.height, clip.width, clip.frames
    r = 0.2 * min(H, W)
    xs = np.linspace(r, W - r, F) if F > 1 else np.array([W / 2])
    return (xs if clip.rightward else xs[::-1]), r


def render(clip: ExampleClip) -> np.ndarray:
    """uint8 [F, H, W, 3]: the shape crosses the frame once, edge to edge, over the clip."""
    xs, r = _path(clip)
    H, W = clip.height, clip.width
    return np.stack([_draw(H, W, clip.background, clip.color, clip.shape, float(x), H / 2, r) for x in xs])


def render_mask(clip: ExampleClip) -> np.ndarray:
    """uint8 [F, H, W, 3] grey loss mask: 255 on the shape, 64 on a band of r/2 around it, 0 elsewhere."""
    xs, r = _path(clip)
    H, W = clip.height, clip.width
    band = [_draw(H, W, "black", "white", clip.shape, float(x), H / 2, 1.5 * r) for x in xs]
    shape = [_draw(H, W, "black", "white", clip.shape, float(x), H / 2, r) for x in xs]
    return np.stack([np.where(s > 128, 255, np.where(b > 128, 64, 0)).astype(np.uint8) for s, b in zip(shape, band)])


def render_control(clip: ExampleClip) -> np.ndarray:
    """uint8 [F, H, W, 3] control video: the shape's white silhouette on black (a segmentation map)."""
    xs, r = _path(clip)
    return np.stack([_draw(clip.height, clip.width, "black", "white", clip.shape, float(x), clip.height / 2, r)
                     for x in xs])


def write_example_videos(root: str | os.PathLike, clips: tuple[ExampleClip, ...] | list[ExampleClip] = EXAMPLE_CLIPS,
                         masks: bool = False, control: bool = False) -> list[Path]:
    """Write `clips` (mp4 + caption .txt, and with `masks` / `control` clip.mask.mp4 /
    clip.control.mp4 beside each) into the folder `root` (created); returns the clips' mp4 paths."""
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for clip in clips:
        path = root / clip.name
        write_mp4(path, render(clip), fps=clip.fps)
        path.with_suffix(".txt").write_text(clip.caption + "\n")
        if masks:
            write_mp4(path.with_suffix(".mask.mp4"), render_mask(clip), fps=clip.fps)
        if control:
            write_mp4(path.with_suffix(".control.mp4"), render_control(clip), fps=clip.fps)
        out.append(path)
    return out
