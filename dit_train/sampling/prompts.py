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

import torch

from dit_train.data_pipelines import DataSource, source_for
from dit_train.data_pipelines.prompt_space import PromptSpace, fit_to_patch, notice_cut
from dit_train.sampling.sampler import SampleRequest
from dit_train.tasks.captions import ByteCaptionEncoder


def prompt_space(cfg, device: str | torch.device = "cpu", source: DataSource | None = None) -> PromptSpace:
    """The PromptSpace of a run's config (data and model nodes); `source`: the run's data source
    when the caller has it (data_pipelines.run_source: as the run folder recorded it)."""
    m, d = cfg.model, cfg.data
    pt, ph, pw = m.patch_size
    space = (source or source_for(d, m)).prompt_space(device)
    if space is not None:  # a source whose samples are not pixels maps prompts itself (a latent cache)
        return space
    # the training task's encoder (the same word vectors with model.caption_words)
    encoder = ByteCaptionEncoder(m.text_dim, m.text_len, words=getattr(m, "caption_words", False)) if m.text_dim else None

    def encode_bytes(caption: str) -> torch.Tensor:
        notice_cut(caption, len(caption.encode("utf-8")), m.text_len, "bytes")
        return encoder(caption)

    def pixel_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return (m.in_channels, fit_to_patch(frames, pt, "--frames"), fit_to_patch(height, ph, "--height"),
                fit_to_patch(width, pw, "--width"))

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
