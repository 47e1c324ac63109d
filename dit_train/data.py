"""Data sources -> tasks. `prepare_data` runs once before workers start (writes the embedded
set); `build_task` runs in every worker and only reads."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dit_train.config import DataConfig, LossConfig, ModelConfig


def _synthetic_dir(cfg: DataConfig) -> Path:
    from data_pipelines.synthetic_video import dataset_dir

    return dataset_dir(cfg.cache_dir, cfg.num_clips, cfg.gen_seed)


def prepare_data(mode: str, cfg: DataConfig) -> None:
    """Create what must exist on disk before training (idempotent, safe to race): the embedded
    clips, or the probe index of a video folder (so workers read it instead of probing)."""
    if mode == "video" and cfg.name == "synthetic_video":
        from data_pipelines.synthetic_video import ensure_synthetic_videos

        ensure_synthetic_videos(cfg.cache_dir, cfg.num_clips, cfg.gen_seed)
    elif mode == "video" and cfg.name == "video_folder":
        from data_pipelines.video_folder import index_video_folder

        index_video_folder(cfg.root, cfg.cache_dir, cfg.num_workers)


def build_pixel_dataset(cfg: DataConfig, patch: tuple[int, int, int], cache_items: int | None = None) -> Any:
    """The clips of a pixel source (synthetic_video | video_folder) as a VideoClipDataset that
    crops frames to multiples of patch[0] and sizes to multiples of patch[1:] (or buckets).
    Clips that cannot be read or are too small are left out and listed in `.skipped`."""
    from data_pipelines.video_dataset import VideoClipDataset

    kw = dict(patch=tuple(patch), max_frames=cfg.max_frames, frame_stride=cfg.frame_stride, fps=cfg.fps,
              buckets=[tuple(b) for b in cfg.resolution_buckets],
              cache_items=cfg.decoded_cache_items if cache_items is None else cache_items)
    if cfg.name == "synthetic_video":
        return VideoClipDataset.from_manifest(_synthetic_dir(cfg) / "manifest.jsonl", **kw)
    if cfg.name == "video_folder":
        from data_pipelines.video_folder import index_video_folder

        if not cfg.root:
            raise ValueError("data=video_folder needs data.root=<folder of videos, or a .csv/.jsonl manifest>")
        index = index_video_folder(cfg.root, cfg.cache_dir, cfg.num_workers)
        if not index.entries:
            raise ValueError(f"no readable video under data.root={cfg.root} ({len(index.skipped)} unreadable, "
                             f"e.g. {index.skipped[0][0]}: {index.skipped[0][1]})")
        ds = VideoClipDataset(index.entries, **kw)
        ds.skipped = index.skipped + ds.skipped
        return ds
    raise ValueError(f"data.name={cfg.name!r} is not a pixel video source (use synthetic_video or video_folder)")


def build_video_dataset(cfg: DataConfig, model_cfg: ModelConfig) -> Any:
    """The samples of mode=video; wrapped in a background decoder when data.num_workers > 0."""
    patch = tuple(model_cfg.patch_size)
    if cfg.name == "latent_cache":
        from data_pipelines.latent_cache import LatentCacheDataset, read_meta

        if not cfg.root:
            raise ValueError("data=latent_cache needs data.root=<folder written by tools/cache_latents.py>")
        meta = read_meta(cfg.root)
        channels, text_dim = int(meta["latent_channels"]), int(meta.get("text_dim", 0))
        if model_cfg.in_channels != channels:
            raise ValueError(f"the latent cache {cfg.root} holds {channels}-channel latents but "
                             f"model.in_channels={model_cfg.in_channels}; set model.in_channels={channels}")
        if model_cfg.text_dim and text_dim and model_cfg.text_dim != text_dim:
            raise ValueError(f"the latent cache {cfg.root} holds {text_dim}-wide caption embeddings but "
                             f"model.text_dim={model_cfg.text_dim}; set model.text_dim={text_dim}")
        ds = LatentCacheDataset(cfg.root, patch)
    elif cfg.name in ("synthetic_video", "video_folder"):
        if model_cfg.in_channels != 3:
            raise ValueError(f"data={cfg.name} gives RGB pixels but model.in_channels={model_cfg.in_channels}; "
                             f"set model.in_channels=3 (or train on data=latent_cache)")
        ds = build_pixel_dataset(cfg, patch)
    else:
        raise ValueError(f"data.name={cfg.name!r} is not a video source for mode=video "
                         f"(use synthetic_video, video_folder or latent_cache)")
    if cfg.num_workers > 0:
        from data_pipelines.prefetch import Prefetcher

        ds = Prefetcher(ds, cfg.num_workers)
    return ds


def build_text_datasets(cfg: DataConfig, model_cfg: ModelConfig) -> tuple[Any, Any]:
    from data_pipelines.text import load_text_datasets

    if cfg.name != "text":
        raise ValueError(f"data.name={cfg.name!r} is not a text source for mode=llm (use data=text)")
    train, heldout = load_text_datasets(cfg.text_path, cfg.tokenizer, cfg.max_doc_tokens, cfg.heldout_fraction)
    if train.tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the {cfg.tokenizer} tokenizer has {train.tokenizer.vocab_size} ids but "
                         f"model.vocab_size={model_cfg.vocab_size}; raise model.vocab_size")
    return train, heldout


def build_task(mode: str, data: DataConfig, model: ModelConfig, loss: LossConfig, seed: int,
               split: str = "train") -> Any:
    """The task of `mode` over the configured data (`split="heldout"` for evaluation data;
    None when the source has no held-out part)."""
    if mode == "video":
        from dit_train.tasks.video import VideoTask

        if split != "train":
            return None
        return VideoTask(build_video_dataset(data, model), model, loss, seed, caption_dropout=data.caption_dropout)
    if mode == "llm":
        from dit_train.tasks.llm import LMTask

        train, heldout = build_text_datasets(data, model)
        ds = train if split == "train" else heldout
        return LMTask(ds) if ds is not None else None
    raise ValueError(f"mode={mode!r} must be video or llm")


def check_data(cfg) -> None:
    """Fail before training if the data cannot fill a step or a sample cannot fit a micro-batch."""
    from dit_train.validate import ConfigError

    try:
        lengths = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed).lengths()
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if len(lengths) < cfg.train.global_batch:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is larger than the dataset "
                          f"({len(lengths)} samples); lower it or add data")
    longest = max(lengths)
    if longest > cfg.train.micro_batch_tokens:
        raise ConfigError(f"the longest sample has {longest} tokens but train.micro_batch_tokens="
                          f"{cfg.train.micro_batch_tokens}; raise train.micro_batch_tokens to at least {longest} "
                          f"(or lower data.max_frames / the resolution)")
