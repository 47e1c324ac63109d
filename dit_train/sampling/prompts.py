"""Sampling from a user's prompts: captions encoded, and clip sizes mapped to model space, the
way the run's data was.

- pixel runs (synthetic_video, video_folder): the byte-level caption embedding the model was
  trained with (dit_train/tasks/captions.py); clips of (3, frames, height, width), each cut down
  to a multiple of the patch;
- latent-cache runs: the cache's own text encoder (meta.json) encodes the prompt and its VAE
  decodes the sampled latents; (frames, height, width) are pixel sizes, turned into the latent
  grid by the VAE's compression factors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from dit_train.data_pipelines.latent_cache import read_cache_info, TextEncoder, VaeCodec
from dit_train.sampling.sampler import SampleRequest
from dit_train.tasks.captions import ByteCaptionEncoder

log = logging.getLogger(__name__)


@dataclass
class PromptSpace:
    """How prompts and sizes become model inputs for one run.

    encode: caption -> [Lt, text_dim] (None for an unconditional model); null: the empty caption.
    shape: (frames, height, width) in pixels -> (C, F, H, W) in model space.
    decode: model-space clip -> pixels [3, F, H, W] in [-1, 1] (None: already pixels).
    """

    encode: Callable[[str], torch.Tensor] | None
    null: torch.Tensor | None
    shape: Callable[[int, int, int], tuple[int, int, int, int]]
    decode: Callable[[torch.Tensor], torch.Tensor] | None
    fps: float


def _multiple(x: int, m: int, what: str) -> int:
    y = max(m, x - x % m)
    if y != x:
        log.warning("%s=%d is not a multiple of the model's patch %d: using %d", what, x, m, y)
    return y


def _notice_cut(caption: str, length: int, keep: int, unit: str) -> None:
    """Say so when a prompt is longer than the model reads (model.text_len): the rest is ignored."""
    if length > keep:
        shown = caption if len(caption) <= 40 else caption[:40] + "..."
        log.warning("the prompt %r is %d %s long; the model reads the first %d (model.text_len=%d), the rest is "
                    "ignored", shown, length, unit, keep, keep)


def prompt_space(cfg, device: str | torch.device = "cpu") -> PromptSpace:
    """The PromptSpace of a run's config (data and model nodes)."""
    m, d = cfg.model, cfg.data
    pt, ph, pw = m.patch_size
    if d.name == "latent_cache":
        info = read_cache_info(d.root)
        vae = VaeCodec(info["vae"], device)
        encode, null = None, None
        if m.text_dim:
            if not info.get("text_encoder"):
                raise ValueError(f"the latent cache {d.root} was made without a text encoder: prompts cannot be encoded")
            text = TextEncoder(info["text_encoder"], info.get("tokenizer", ""), int(info.get("max_text_len") or 512), device)

            def encode_tokens(caption: str) -> torch.Tensor:
                emb = text.encode(caption)
                _notice_cut(caption, emb.shape[0], m.text_len, "tokens")
                return emb[: m.text_len]

            encode, null = encode_tokens, encode_tokens("")

        def latent_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
            c, f, h, w = vae.latent_shape(frames, height, width)
            return c, _multiple(f, pt, "latent frames"), _multiple(h, ph, "latent height"), _multiple(w, pw, "latent width")

        return PromptSpace(encode, null, latent_shape, vae.decode, 16.0)

    # the training task's encoder (the same word vectors with model.caption_words)
    encoder = ByteCaptionEncoder(m.text_dim, m.text_len, words=getattr(m, "caption_words", False)) if m.text_dim else None

    def encode_bytes(caption: str) -> torch.Tensor:
        _notice_cut(caption, len(caption.encode("utf-8")), m.text_len, "bytes")
        return encoder(caption)

    def pixel_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return (m.in_channels, _multiple(frames, pt, "--frames"), _multiple(height, ph, "--height"),
                _multiple(width, pw, "--width"))

    fps = getattr(d, "fps", 0.0) or 8.0
    return PromptSpace(encode_bytes if encoder else None, encoder("") if encoder else None, pixel_shape, None, fps)


def prompt_requests(space: PromptSpace, prompts: list[str], num: int, frames: int, height: int,
                    width: int) -> list[SampleRequest]:
    """`num` clips per prompt, keyed prompt_<k>_<j>; noise ids 0, 1, 2, ... in that order."""
    shape = space.shape(frames, height, width)
    out = []
    for k, prompt in enumerate(prompts):
        ctx = space.encode(prompt) if space.encode else None
        for j in range(num):
            out.append(SampleRequest(f"prompt_{k}_{j}", shape, prompt, ctx, k * num + j, space.fps, still=frames == 1))
    return out
