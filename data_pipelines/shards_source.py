"""`data=shards data.url=URL`: webdataset-format tar shards with an index, on a local disk or any
fsspec URL (s3://, gs://, https://), made by `python -m dit_train.tools.make_shards` (from a video
folder, a manifest, the embedded clips or a latent cache) or by `tools.cache_latents --out URL`.

The index gives every sample's length without touching the shards (the step plan is made from
lengths alone), and each sample is read by one byte-range request into its tar. Pixel shards
train like the folder they were made from (the same data.* read settings apply), latent shards
like the latent cache: `for_config` picks the source class that fits the index's kind.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict

import torch

from dit_train.config.choices import Mode
from dit_train.data_pipelines.latent_encoders import VaeCodec
from dit_train.data_pipelines.latent_cache_source import check_latent_model, latent_prompt_space, latent_sound
from dit_train.data_pipelines.prompt_space import PromptSpace
from dit_train.data_pipelines.shard_datasets import ShardClipDataset, ShardLatentDataset, pixel_entries
from dit_train.data_pipelines.shard_index import KINDS, ShardIndex, load_index
from dit_train.data_pipelines.shard_store import ShardCache, ShardReader, is_remote
from dit_train.data_pipelines.source import DataSource, register_source
from dit_train.data_pipelines.video_source import PixelVideoSource, VideoReadConfig


@dataclass
class ShardsConfig(VideoReadConfig):
    name: str = "shards"
    url: str = ""  # the shard set: a local folder or an fsspec URL (s3://bucket/prefix, gs://..., https://...)
    # fsspec storage options of the URL's filesystem (s3fs: key, secret, profile, anon,
    # client_kwargs.endpoint_url, config_kwargs, ...); {} = the filesystem's own defaults
    storage_options: Dict[str, Any] = field(default_factory=dict)
    # local copy of whole shards under cache_dir/shards/ (remote URLs), in GB; 0 = read byte ranges only
    shard_cache_gb: float = 0.0
    read_retries: int = 5  # a failed remote read is tried again this many times, then the run stops
    retry_backoff_s: float = 0.5  # wait before the first retry; doubled for each next one


def shard_index(cfg: Any) -> ShardIndex:
    if not cfg.url:
        raise ValueError("data=shards needs data.url=<folder or URL of shards written by python -m "
                         "dit_train.tools.make_shards>")
    return load_index(cfg.url, cfg.storage_options, cfg.read_retries, cfg.retry_backoff_s)


def shard_reader(cfg: Any) -> ShardReader:
    """The reader of cfg.url, with a local shard cache when data.shard_cache_gb > 0 and the URL is remote."""
    cache = (ShardCache(cfg.cache_dir, cfg.url, int(cfg.shard_cache_gb * 1e9))
             if cfg.shard_cache_gb > 0 and is_remote(cfg.url) else None)
    return ShardReader(cfg.url, cfg.storage_options, cfg.read_retries, cfg.retry_backoff_s, cache)


@register_source
class ShardsSource(DataSource):
    """The registered name; the objects are PixelShardsSource or LatentShardsSource (for_config)."""

    name = "shards"
    config = ShardsConfig
    mode = Mode.video
    # latent shards of a cache written with --masks / --control carry them; whether these do is
    # known once the index is read (open() of the class for_config picks refuses what they lack)
    companion_kinds = ("mask", "control")

    @classmethod
    def may_be_latent(cls) -> bool:
        return True  # latent shards (tools.cache_latents --shards, make_shards of a cache)

    @classmethod
    def for_config(cls, cfg: Any, model_cfg: Any, companions: tuple[str, ...] = ()) -> DataSource:
        kind = shard_index(cfg).kind
        return (LatentShardsSource if kind == "latents" else PixelShardsSource)(cfg, model_cfg, companions)

    @classmethod
    def for_run(cls, cfg: Any, model_cfg: Any, record: dict) -> DataSource:
        """The kind (and a latent set's meta: its VAE and text encoder) the run trained on, from its
        folder's record: sampling its prompts needs no shards (they may have moved since). A run
        folder from before the record: the index says, as for_config."""
        if not record:
            return cls.for_config(cfg, model_cfg)
        kind, latent = record.get("kind"), record.get("latent")
        if kind not in KINDS or (kind == "latents") != isinstance(latent, dict):
            raise ValueError(f"the run folder's run.json records its shards as {record!r:.80}, not a record dit_train "
                             f"writes (kind: one of {', '.join(KINDS)}; latents with their meta); remove its \"data\" to "
                             f"read the shard index at data.url instead")
        return LatentShardsSource(cfg, model_cfg, recorded=latent) if kind == "latents" else PixelShardsSource(cfg, model_cfg)


class PixelShardsSource(PixelVideoSource):
    """Shards of video files and stills: the folder's behaviour (read settings, buckets, held-out
    split by file name, fitting keys), the bytes from the tars."""

    name = "shards"
    config = ShardsConfig
    companion_kinds = ("mask", "control")  # written beside each clip by tools.make_shards (shard_writer.pixel_sample)

    def cache_settings(self) -> dict:
        return {**super().cache_settings(), "url": self.cfg.url}

    def run_record(self) -> dict:
        return {"kind": "pixels"}

    def entries(self) -> tuple[list, list]:
        index = shard_index(self.cfg)
        return pixel_entries(index), list(index.skipped)

    def make_dataset(self, entries: list, **kw) -> Any:
        return ShardClipDataset(entries, shard_reader(self.cfg), **kw)


class LatentShardsSource(DataSource):
    """Shards of VAE latents and caption embeddings: the latent cache's behaviour."""

    name = "shards"
    config = ShardsConfig
    mode = Mode.video
    latent = True

    def __init__(self, cfg: Any, model_cfg: Any, companions: tuple[str, ...] = (), recorded: dict | None = None):
        """recorded: the latent meta a run folder kept (ShardsSource.for_run), used instead of the index's."""
        super().__init__(cfg, model_cfg, companions)
        self.recorded = recorded

    def meta(self) -> dict:
        return self.recorded if self.recorded is not None else shard_index(self.cfg).meta["latent"]

    def run_record(self) -> dict:
        return {"kind": "latents", "latent": self.meta()}

    def open(self, split: str = "train") -> Any:
        if split != "train" and self.cfg.heldout_fraction <= 0:
            return None
        index = shard_index(self.cfg)
        check_latent_model(self.meta(), f"the shards at {self.cfg.url}", self.model_cfg, self.companions)
        return ShardLatentDataset(index, shard_reader(self.cfg), tuple(self.model_cfg.patch_size), split=split,
                                  heldout_fraction=self.cfg.heldout_fraction)

    def decoder(self, device: str | torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """The VAE decoder the latents were made with (the shards' meta names its folder)."""
        return VaeCodec(self.meta()["vae"], device).decode

    def sound(self, device: str | torch.device) -> Any:
        """The audio VAE and vocoder the shards' audio latents were made with (--audio-vae), for LTX-2."""
        return latent_sound(self.meta(), self.model_cfg, device)

    def prompt_space(self, device: str | torch.device) -> PromptSpace:
        return latent_prompt_space(self.meta(), f"the shards at {self.cfg.url}", self.model_cfg, device)
