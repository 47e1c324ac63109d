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
    """Create what must exist on disk before training (idempotent, safe to race)."""
    if mode == "video" and cfg.name == "synthetic_video":
        from data_pipelines.synthetic_video import ensure_synthetic_videos

        ensure_synthetic_videos(cfg.cache_dir, cfg.num_clips, cfg.gen_seed)


def build_video_dataset(cfg: DataConfig, model_cfg: ModelConfig) -> Any:
    from data_pipelines.video_dataset import VideoClipDataset

    patch = tuple(model_cfg.patch_size)
    kw = dict(patch=patch, max_frames=cfg.max_frames, frame_stride=cfg.frame_stride, fps=cfg.fps,
              buckets=[tuple(b) for b in cfg.resolution_buckets], cache_items=cfg.decoded_cache_items)
    if cfg.name == "synthetic_video":
        return VideoClipDataset.from_manifest(_synthetic_dir(cfg) / "manifest.jsonl", **kw)
    raise ValueError(f"data.name={cfg.name!r} is not a video source for mode=video "
                     f"(use synthetic_video, video_folder or latent_cache)")


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
        task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
        lengths = task.lengths()
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if len(lengths) < cfg.train.global_batch:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is larger than the dataset "
                          f"({len(lengths)} samples); lower it or add data")
    text_dim = getattr(getattr(task, "dataset", None), "text_dim", None)
    if cfg.mode == "video" and cfg.model.text_dim and text_dim and text_dim != cfg.model.text_dim:
        raise ConfigError(f"the cached caption embeddings are {text_dim}-wide but model.text_dim={cfg.model.text_dim}; "
                          f"set model.text_dim={text_dim}")
    longest = max(lengths)
    if longest > cfg.train.micro_batch_tokens:
        raise ConfigError(f"the longest sample has {longest} tokens but train.micro_batch_tokens="
                          f"{cfg.train.micro_batch_tokens}; raise train.micro_batch_tokens to at least {longest} "
                          f"(or lower data.max_frames / the resolution)")
