"""`data=latent_cache`: VAE latents (+ caption embeddings) written by `dit_train.tools.cache_latents`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dit_train.config.choices import Mode
from dit_train.config.schema import DataConfig
from dit_train.data_pipelines.audio_latents import AudioLatentCodec, LatentSound
from dit_train.data_pipelines.latent_cache import LatentCacheDataset, load_decoder, read_cache_info, uncached_companions
from dit_train.data_pipelines.latent_encoders import TextEncoder, VaeCodec
from dit_train.data_pipelines.prompt_space import PromptSpace, fit_to_patch, notice_cut
from dit_train.data_pipelines.source import DataSource, register_source


@dataclass
class LatentCacheConfig(DataConfig):
    name: str = "latent_cache"
    root: str = ""  # the cache folder


def check_latent_model(meta: dict, where: str, model_cfg: Any, companions: tuple[str, ...] = ()) -> None:
    """Refuse a model that cannot read these latents, or a run that needs `companions` (mask,
    control) the cache was written without (ValueError naming the key or the tool's flag).
    `meta`: the cache's meta.json (latent_channels, text_dim, settings); `where` names the data."""
    missing = uncached_companions(meta, companions, where)
    if missing:
        raise ValueError("; ".join(missing))
    channels, text_dim = int(meta["latent_channels"]), int(meta.get("text_dim", 0))
    if model_cfg.in_channels != channels:
        raise ValueError(f"{where} holds {channels}-channel latents but "
                         f"model.in_channels={model_cfg.in_channels}; set model.in_channels={channels}")
    audio, audio_patch = meta.get("audio") or {}, getattr(model_cfg, "audio_patch", 0)
    if audio and audio_patch and audio_patch != int(audio["token_dim"]):
        raise ValueError(f"{where} holds {audio['token_dim']}-feature audio latents (its audio VAE's latent_channels x "
                         f"mel_bins / 4) but model.audio_patch={audio_patch}; set model.audio_patch={audio['token_dim']}")
    if model_cfg.text_dim and text_dim and model_cfg.text_dim != text_dim:
        raise ValueError(f"{where} holds {text_dim}-wide caption embeddings but "
                         f"model.text_dim={model_cfg.text_dim}; set model.text_dim={text_dim}")


def latent_prompt_space(meta: dict, where: str, model_cfg: Any, device: str | torch.device) -> PromptSpace:
    """The cache's own text encoder encodes a prompt, and its VAE maps (frames, height, width)
    in pixels to the latent grid and decodes the sampled latents (both named by `meta`)."""
    m = model_cfg
    pt, ph, pw = m.patch_size
    vae = VaeCodec(meta["vae"], device)
    encode, null = None, None
    if m.text_dim:
        if not meta.get("text_encoder"):
            raise ValueError(f"{where} was made without a text encoder: prompts cannot be encoded")
        text = TextEncoder(meta["text_encoder"], meta.get("tokenizer", ""), int(meta.get("max_text_len") or 512), device)

        def encode_tokens(caption: str) -> torch.Tensor:
            emb = text.encode(caption)
            notice_cut(caption, emb.shape[0], m.text_len, "tokens")
            return emb[: m.text_len]

        encode, null = encode_tokens, encode_tokens("")

    def latent_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        c, f, h, w = vae.latent_shape(frames, height, width)
        return (c, fit_to_patch(f, pt, "latent frames"), fit_to_patch(h, ph, "latent height"),
                fit_to_patch(w, pw, "latent width"))

    return PromptSpace(encode, null, latent_shape, vae.decode, 16.0, codec=vae)


def latent_sound(meta: dict, model_cfg: Any, device: str | torch.device) -> LatentSound | None:
    """A LatentSound for a model with an audio stream on latents cached with --audio-vae, else None."""
    audio = meta.get("audio")
    if not audio or not getattr(model_cfg, "audio_patch", 0):
        return None
    vae = VaeCodec(meta["vae"], device)
    codec = AudioLatentCodec(audio["audio_vae"], device, vocoder=audio.get("vocoder", ""))
    return LatentSound(codec, lambda shape: vae.pixel_shape(shape)[1], float(getattr(model_cfg, "fps", 0.0) or 24.0))


@register_source
class LatentCacheSource(DataSource):
    name = "latent_cache"
    config = LatentCacheConfig
    mode = Mode.video
    latent = True
    companion_kinds = ("mask", "control")  # when cached with them (tools.cache_latents --masks --control): open() checks

    def open(self, split: str = "train") -> Any:
        if split != "train" and self.cfg.heldout_fraction <= 0:
            return None
        root = self.cfg.root
        if not root:
            raise ValueError("data=latent_cache needs data.root=<folder written by python -m dit_train.tools.cache_latents>")
        check_latent_model(read_cache_info(root), f"the latent cache {root}", self.model_cfg, self.companions)
        return LatentCacheDataset(root, tuple(self.model_cfg.patch_size), split=split,
                                  heldout_fraction=self.cfg.heldout_fraction)

    def decoder(self, device: str | torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """The cache's VAE decoder (meta.json names it)."""
        return load_decoder(self.cfg.root, device)

    def sound(self, device: str | torch.device) -> LatentSound | None:
        """The cache's audio VAE and vocoder (meta.json `audio`) for an LTX-2 run of its audio latents."""
        return latent_sound(read_cache_info(self.cfg.root), self.model_cfg, device)

    def prompt_space(self, device: str | torch.device) -> PromptSpace:
        return latent_prompt_space(read_cache_info(self.cfg.root), f"the latent cache {self.cfg.root}", self.model_cfg,
                                   device)
