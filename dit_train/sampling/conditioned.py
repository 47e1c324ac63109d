"""The given frames of conditioned sampling (tasks/conditioning.py): from dataset clips
(validation, `tools.sample --data-captions`) or from a user's files (`tools.sample --image
first.png [--last-image last.png]`, `--video prefix.mp4 --prefix-frames k`).

A request's `given` is a clip of the request's shape holding the given frames where its
`given_patches` say (temporal patches: model.patch_size[0] frames each); the sampler keeps them
clean (timestep feed) or feeds them as channels (concat feed). Pixel runs only: on a latent
cache the frames would first go through the cache's VAE (issue 32's second half).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dit_train.data_pipelines.shapes_metric import score_given_clips
from dit_train.data_pipelines.sizes import resize_crop
from dit_train.data_pipelines.video_io import is_image, probe, read_frames, to_model_range, VideoReadError
from dit_train.sampling.sampler import SampleRequest
from dit_train.tasks import build_task
from dit_train.config.schema import cond_active
from dit_train.tasks.conditioning import context_patches

log = logging.getLogger(__name__)


def sampler_feed(cond: Any) -> str:
    """The sampler's cond_feed of a run: its cond.feed when it trained conditioned, else ""."""
    return str(cond.feed) if cond_active(cond) else ""


def condition_on_clips(requests: list[SampleRequest], clips: list[torch.Tensor], cond: Any, pt: int) -> int:
    """Give each request the context frames of its real clip ([C, F, H, W], the request's shape),
    as cond.kind chooses them (every request is conditioned: cond.prob is a training knob).
    A clip too short for its conditioning is left unconditioned. Returns how many were."""
    done = 0
    for r, clip in zip(requests, clips):
        patches = context_patches(cond, pt, clip.shape[1] // pt)
        if patches is not None:
            r.given, r.given_patches = clip, patches
            done += 1
    return done


def validation_task(cfg: Any, task: Any) -> Any:
    """The task validation samples from: for a conditioned run with data.heldout_fraction > 0 its
    held-out clips (their true first frames are unseen in training), else the training task."""
    if not cond_active(cfg.cond) or getattr(cfg.data, "heldout_fraction", 0) <= 0:
        return task

    return build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, split="heldout", cond=cfg.cond)


def _read_pixels(path: str, frames: int, pt: int) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1]: an image repeated to one temporal patch, or a video's first
    `frames` frames (at its native rate)."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    try:
        info = probe(path)
        if is_image(path):
            return to_model_range(read_frames(path, [0] * pt, info))
        if info.frames < frames:
            raise ValueError(f"{path} has {info.frames} frames; --prefix-frames={frames} needs at least that many")
        return to_model_range(read_frames(path, list(range(frames)), info))
    except VideoReadError as err:
        raise ValueError(str(err)) from None


def given_from_files(cond: Any, shape: tuple[int, int, int, int], pt: int, image: str = "", last_image: str = "",
                     video: str = "", prefix_frames: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(given [C, F, H, W], given_patches [F/pt]) for a request of `shape` from the user's files,
    each resized to cover the request's height x width and centre-cropped (as data buckets are).
    cond.kind decides which files it takes (ValueError naming the flag otherwise):
    first_frame --image; first_last --image and --last-image; prefix --video (its first
    prefix_frames frames, a multiple of pt; default cond.prefix_frames)."""
    C, F, H, W = shape
    if C != 3:
        raise ValueError("conditioning files need a pixel-space run (data=synthetic_video or video_folder); "
                         "latent-cache runs do not encode them yet")
    f = F // pt
    kind = str(cond.kind)
    need = {"first_frame": "--image", "first_last": "--image and --last-image",
            "prefix": "--video and --prefix-frames"}[kind]
    given = torch.zeros(shape)
    patches = torch.zeros(f, dtype=torch.bool)

    def put(path: str, first_patch: int, frames: int) -> None:
        pixels = resize_crop(_read_pixels(path, frames, pt), H, W, resize=True)
        given[:, first_patch * pt:first_patch * pt + pixels.shape[1]] = pixels
        patches[first_patch:first_patch + pixels.shape[1] // pt] = True

    if kind in ("first_frame", "first_last"):
        if video or (kind == "first_frame" and last_image) or not image or (kind == "first_last" and not last_image):
            raise ValueError(f"this run trained cond.kind={kind}: give {need}")
        if f < (3 if kind == "first_last" else 2):
            raise ValueError(f"--frames={F} leaves no frame to generate after the given ones (temporal patches of "
                             f"{pt} frames); raise --frames")
        put(image, 0, pt)
        if kind == "first_last":
            put(last_image, f - 1, pt)
    else:
        k = prefix_frames or cond.prefix_frames or pt
        if image or last_image or not video:
            raise ValueError(f"this run trained cond.kind={kind}: give {need}")
        if k % pt or k >= F:
            raise ValueError(f"--prefix-frames={k} must be a multiple of the model's temporal patch ({pt}) and "
                             f"below --frames={F}")
        put(video, 0, k)
    return given, patches


def given_scores(source: Any, requests: list[SampleRequest], pixels: list[torch.Tensor], pt: int) -> dict[str, float]:
    """First-frame consistency figures (eval/kept_*, eval/motion_after_ok) of the requests that
    had given frames, where the data is the embedded shapes world ({} elsewhere, or without any)."""
    if getattr(source, "name", "") != "synthetic_video":
        return {}

    chosen = [(r, p) for r, p in zip(requests, pixels) if r.given is not None]
    if not chosen:
        return {}
    masks = [r.given_patches.repeat_interleave(pt).numpy() for r, _ in chosen]
    return score_given_clips([p for _, p in chosen], masks, [r.caption for r, _ in chosen],
                             [r.given for r, _ in chosen])
