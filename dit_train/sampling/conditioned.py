"""The given frames of conditioned sampling (tasks/conditioning.py): from dataset clips
(validation, `tools.sample --data-captions`) or from a user's files (`tools.sample --image
first.png [--last-image last.png]`, `--video prefix.mp4 --prefix-frames k`).

A request's `given` is a clip of the request's shape holding the given frames where its
`given_patches` say (temporal patches: model.patch_size[0] frames each); the sampler keeps them
clean (timestep feed) or feeds them as channels (concat feed). On a latent cache the user's
frames go through the cache's VAE first (`given_latents_from_files`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dit_train.data_pipelines.i2v_cache import ImageEncoder
from dit_train.data_pipelines.shapes_metric import score_given_clips
from dit_train.data_pipelines.sizes import resize_crop
from dit_train.data_pipelines.video_io import is_image, probe, read_frames, to_model_range, VideoReadError
from dit_train.sampling.sampler import SampleRequest
from dit_train.tasks import build_task
from dit_train.config.cond import cond_active
from dit_train.tasks.conditioning import context_patches, vace_context

log = logging.getLogger(__name__)


def given_flags(cond: Any) -> str:
    """The flags (with example files) that give a conditioned run's frames to `tools.sample`."""
    if cond.from_prefix:
        return "--video clip.mp4"
    return "--image first.png" + (" --last-image last.png" if cond.gives_last else "")


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


def control_on_clips(requests: list[SampleRequest], task: Any) -> None:
    """Give each request its dataset clip's control video (a run trained with cond.control; Wan
    VACE: the context built from it, as in training: task.control_input)."""
    for r in requests:
        r.control = task.control_input(task.dataset[r.noise_id])


def i2v_on_clips(requests: list[SampleRequest], task: Any) -> None:
    """Give each request its dataset clip's Wan 2.1 I2V condition latents and image tokens (a
    model with model.mask_channels > 1); an unconditioned request sees zero image tokens, as in
    training."""
    for r in requests:
        item = task.dataset[r.noise_id]
        r.cond_latents = item.cond_latents
        if item.image_emb is not None:
            r.image = item.image_emb if r.given is not None else item.image_emb * 0


def validation_task(cfg: Any, task: Any) -> Any:
    """The task validation samples from: for a conditioned run (cond.kind, or cond.control) with
    data.heldout_fraction > 0 its held-out clips (their true first frames and control videos are
    unseen in training), else the training task."""
    given = cond_active(cfg.cond) or getattr(cfg.cond, "control", False)
    if not given or getattr(cfg.data, "heldout_fraction", 0) <= 0:
        return task

    return build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, split="heldout", cond=cfg.cond)


def _read_pixels(path: str, frames: int, pt: int, need: str = "") -> torch.Tensor:
    """[3, F, H, W] in [-1, 1]: an image repeated to one temporal patch, or a video's first
    `frames` frames (at its native rate); `need` names the flag asking for them (errors)."""
    if Path(path).is_dir():
        raise ValueError(f"{path} is a folder: give one image or video file")
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    try:
        info = probe(path)
        if is_image(path):
            return to_model_range(read_frames(path, [0] * pt, info))
        if info.frames < frames:
            raise ValueError(f"{path} has {info.frames} frames; {need or f'--prefix-frames={frames}'} needs at least "
                             f"that many")
        return to_model_range(read_frames(path, list(range(frames)), info))
    except VideoReadError as err:
        raise ValueError(str(err)) from None


def control_from_file(path: str, shape: tuple[int, int, int, int], codec: Any = None,
                      vace_mask: int = 0) -> torch.Tensor:
    """[C, F, H, W] control video for a request of `shape` from `--control`: its first F frames
    (an image: repeated), resized to cover H x W and centre-cropped, as data buckets are. On a
    latent run (`codec`: the cache's VAE, t frames per latent frame, s pixels per latent pixel)
    `shape` is the latent grid [C, f, h, w]: the first 1 + t·(f − 1) frames at (s·h, s·w) are
    encoded, as `tools.cache_latents --control` encodes a clip's control video. `vace_mask` > 0
    (Wan VACE, model.vace_mask_channels): the VACE context [2C + k, F, H, W] built from it, the
    inactive video the zero video encoded as the cache encodes it (tasks/conditioning.vace_context)."""
    if vace_mask:
        control = control_from_file(path, shape, codec)
        inactive = None if codec is None else codec.encode(torch.zeros(codec.pixel_shape(shape)))
        return vace_context(control, inactive, vace_mask)
    if codec is not None:
        return codec.encode(control_from_file(path, codec.pixel_shape(shape)))
    C, F, H, W = shape
    if C != 3:
        raise ValueError("--control needs a pixel-space run (data=synthetic_video or video_folder)")
    if is_image(path):
        pixels = _read_pixels(path, 1, 1).expand(-1, F, -1, -1)
    else:
        pixels = _read_pixels(path, F, 1, need=f"--control with --frames={F}")
    return resize_crop(pixels.contiguous(), H, W, resize=True)


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
    kind, last = cond.kind, cond.gives_last
    need = "--video and --prefix-frames" if cond.from_prefix else "--image" + (" and --last-image" if last else "")
    given = torch.zeros(shape)
    patches = torch.zeros(f, dtype=torch.bool)

    def put(path: str, first_patch: int, frames: int) -> None:
        pixels = resize_crop(_read_pixels(path, frames, pt), H, W, resize=True)
        given[:, first_patch * pt:first_patch * pt + pixels.shape[1]] = pixels
        patches[first_patch:first_patch + pixels.shape[1] // pt] = True

    if cond.from_images:
        if not last and last_image:  # the flag it cannot use, named (it said "give --image")
            raise ValueError("--last-image: this run trained cond.kind=first_frame (the first frame only); drop "
                             "--last-image (cond.kind=first_last runs take both)")
        if video:
            raise ValueError(f"--video: this run trained cond.kind={kind}; give {need} instead")
        if not image or (last and not last_image):
            raise ValueError(f"this run trained cond.kind={kind}: give {need}")
        if f < (3 if last else 2):
            raise ValueError(f"--frames={F} leaves no frame to generate after the given ones (temporal patches of "
                             f"{pt} frames); raise --frames")
        put(image, 0, pt)
        if last:
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


def given_latents_from_files(cond: Any, shape: tuple[int, int, int, int], pt: int, codec: Any, image: str = "",
                             last_image: str = "", video: str = "", prefix_frames: int = 0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(given [C, f, h, w], given_patches [f/pt]) in a latent cache's space, from the user's files
    encoded by the cache's VAE (`codec`: a latent_cache.VaeCodec, t frames per latent frame).

    A causal video VAE (Wan's) encodes frame 0 alone and every later latent frame from its t
    frames and their past, so the first k latent frames of a clip are the encoding of its first
    1 + t·(k − 1) frames, whatever follows: an image repeated to that length (a still image, as
    training reads one) gives first_frame's context, a video's first frames prefix's, and both
    equal what the cache holds for a clip that starts with them. The last latent frame is not the
    last image on its own: first_last is refused (ValueError naming --last-image)."""
    C, f, h, w = shape
    kind, prefix = cond.kind, cond.from_prefix
    if cond.gives_last or last_image:
        raise ValueError("--last-image on a latent-cache run: the VAE encodes a clip's last latent frame from its "
                         f"last {codec.temporal} frames and their past, not from one image; sample a pixel-space "
                         "run, or train cond.kind=first_frame")
    # first_last is refused above: the kind is first_frame or prefix
    k = (prefix_frames or cond.prefix_frames or pt) if prefix else pt
    flag = "--video and --prefix-frames" if prefix else "--image"
    if (not prefix and (video or not image)) or (prefix and (image or not video)):
        raise ValueError(f"this run trained cond.kind={kind}: give {flag}")
    if k % pt or k >= f:
        raise ValueError(f"{'--prefix-frames' if prefix else '--image'} gives {k} latent frame(s) (temporal "
                         f"patches of {pt}); --frames must leave latent frames to generate: {f} now")
    frames = 1 + codec.temporal * (k - 1)
    H, W = h * codec.spatial, w * codec.spatial
    if not prefix:
        pixels = _read_pixels(image, 1, 1).expand(-1, frames, -1, -1)
    else:
        pixels = _read_pixels(video, frames, 1)
    latents = codec.encode(resize_crop(pixels, H, W, resize=True).contiguous())
    given = torch.zeros(shape)
    given[:, :k] = latents[:, :k]
    patches = torch.zeros(f // pt, dtype=torch.bool)
    patches[: k // pt] = True
    return given, patches


def i2v_from_files(cond: Any, shape: tuple[int, int, int, int], codec: Any, meta: dict, image: str = "",
                   last_image: str = "", video: str = "") -> tuple:
    """(given, given_patches, cond_latents, image tokens) of diffusers' Wan 2.1 I2V layout from
    --image [--last-image], as WanImageToVideoPipeline builds them: the image resized to cover
    the latent grid's pixels, [image, zeros...(, last)] of the clip's 1 + t·(f − 1) frames through
    the cache's VAE (`codec`), the images through the cache's CLIP encoder (meta.json's
    settings.i2v); `given` is a placeholder (the sampler reads cond_latents)."""
    C, f, h, w = shape
    if video or not image or cond.gives_last != bool(last_image):
        raise ValueError(f"this run trained cond.kind={cond.kind} in Wan 2.1 I2V's layout (model.mask_channels): give "
                         f"{given_flags(cond)}")
    patches = context_patches(cond, 1, f)
    if patches is None:
        raise ValueError(f"--frames gives {f} latent frame(s): nothing would be left to generate after the given ones")
    H, W = h * codec.spatial, w * codec.spatial
    images = [resize_crop(_read_pixels(p, 1, 1), H, W, resize=True)[:, 0] for p in (image, last_image) if p]
    clip = torch.zeros(codec.pixel_shape(shape))
    clip[:, 0] = images[0]
    if last_image:
        clip[:, -1] = images[1]
    cond_latents = codec.encode(clip)
    info = (meta.get("settings") or {}).get("i2v") or {}
    tokens = None
    if info.get("image_encoder"):
        tokens = ImageEncoder(info["image_encoder"], processor=info.get("image_processor", "")).encode(images)
    return torch.zeros(shape), patches, cond_latents, tokens


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
