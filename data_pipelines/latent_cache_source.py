"""`data=latent_cache`: VAE latents (+ caption embeddings) written by `dit_train.tools.cache_latents`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dit_train.config.choices import Mode
from dit_train.config.schema import DataConfig
from dit_train.data_pipelines.latent_cache import LatentCacheDataset, read_cache_info
from dit_train.data_pipelines.source import DataSource, register_source


@dataclass
class LatentCacheConfig(DataConfig):
    name: str = "latent_cache"
    root: str = ""  # the cache folder


@register_source
class LatentCacheSource(DataSource):
    name = "latent_cache"
    config = LatentCacheConfig
    mode = Mode.video

    def open(self, split: str = "train") -> Any:
        if split != "train" and self.cfg.heldout_fraction <= 0:
            return None
        root, m = self.cfg.root, self.model_cfg
        if not root:
            raise ValueError("data=latent_cache needs data.root=<folder written by python -m dit_train.tools.cache_latents>")
        meta = read_cache_info(root)
        channels, text_dim = int(meta["latent_channels"]), int(meta.get("text_dim", 0))
        if m.in_channels != channels:
            raise ValueError(f"the latent cache {root} holds {channels}-channel latents but "
                             f"model.in_channels={m.in_channels}; set model.in_channels={channels}")
        if m.text_dim and text_dim and m.text_dim != text_dim:
            raise ValueError(f"the latent cache {root} holds {text_dim}-wide caption embeddings but "
                             f"model.text_dim={m.text_dim}; set model.text_dim={text_dim}")
        return LatentCacheDataset(root, tuple(m.patch_size), split=split, heldout_fraction=self.cfg.heldout_fraction)
