"""Data sources -> tasks. `prepare_data` runs once before workers start (may write the embedded
set or a probe index); `build_task` runs in every worker and only reads.

Sources are found by name in `SOURCES` (see source.py for the protocol); the task is chosen
by the mode (video: `VideoTask`, llm: `LMTask`).
"""
from __future__ import annotations

import logging
from typing import Any

from dit_train.config.schema import AUTO_MICRO_BATCH_TOKENS
from dit_train.data import latent_cache, synthetic_video, text, video_folder  # noqa: F401  (register)
from dit_train.data.source import SOURCES, DataSource, Dataset, register_source, source_for

log = logging.getLogger(__name__)


def prepare_data(data_cfg: Any, model_cfg: Any = None) -> None:
    """Create what must exist on disk before training (idempotent, safe to race)."""
    source_for(data_cfg, model_cfg).prepare()


def open_dataset(data_cfg: Any, model_cfg: Any, split: str = "train") -> Any:
    """The source's dataset of `split` (None if it has none), wrapped in background decoding
    when data.num_workers > 0."""
    ds = source_for(data_cfg, model_cfg).open(split)
    if ds is not None and data_cfg.num_workers > 0 and split == "train":
        from dit_train.data_pipelines.prefetch import Prefetcher

        ds = Prefetcher(ds, data_cfg.num_workers)
    return ds


def build_task(mode: str, data: Any, model: Any, loss: Any, seed: int, split: str = "train", cond: Any = None) -> Any:
    """The task of `mode` over the configured data (`split="heldout"` for evaluation data;
    None when the source has no held-out part); `cond`: the run's conditioning (video only)."""
    src = SOURCES[data.name]
    if src.mode != mode:
        raise ValueError(f"data={data.name} is a source for mode={src.mode}, not mode={mode}")
    ds = open_dataset(data, model, split)
    if ds is None:
        return None
    if mode == "video":
        from dit_train.tasks.video import VideoTask

        # held-out clips are scored with their captions (no dropout), fixed noise and times
        dropout = data.caption_dropout if split == "train" else 0.0
        return VideoTask(ds, model, loss, seed, caption_dropout=dropout, cond=cond)
    from dit_train.tasks.llm import LMTask

    return LMTask(ds)


def auto_micro_batch_tokens(lengths: list[int]) -> int:
    """train.micro_batch_tokens=0: the longest sample, at least AUTO_MICRO_BATCH_TOKENS."""
    return max(max(lengths, default=0), AUTO_MICRO_BATCH_TOKENS)


def check_data(cfg: Any) -> list[int]:
    """Fail before training if the data cannot fill a step or a sample cannot fit a micro-batch
    (each error names the keys and values that would work); resolve train.micro_batch_tokens=0
    (auto) to the longest sample (at least the default budget). Returns the samples' lengths
    (what the step plan is made from)."""
    from dit_train.engine.checks import ConfigError

    try:
        task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
        lengths = task.lengths()
    except (ValueError, OSError) as err:  # data that cannot be read (a missing corpus, a bad file): one line
        raise ConfigError(str(err)) from err
    if len(lengths) < cfg.train.global_batch:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is larger than the dataset "
                          f"({len(lengths)} samples); set train.global_batch={len(lengths)} (the largest that "
                          f"fits) or add data")
    longest = max(lengths)
    if cfg.train.micro_batch_tokens == 0:
        cfg.train.micro_batch_tokens = auto_micro_batch_tokens(lengths)
        if longest > AUTO_MICRO_BATCH_TOKENS:  # the budget followed the data: say so (memory grows with it)
            log.info("train.micro_batch_tokens=0 (auto): %d tokens, the longest sample", longest)
    budget = cfg.train.micro_batch_tokens
    if longest > budget:
        source = source_for(cfg.data, cfg.model)
        which = source.describe(task.dataset, lengths.index(longest))
        fits = source.fitting_keys(task.dataset, budget)
        raise ConfigError(f"the longest sample has {longest} tokens{f' ({which})' if which else ''} but "
                          f"train.micro_batch_tokens={budget}; raise train.micro_batch_tokens to at least {longest} "
                          f"(or 0 = auto: the longest sample)"
                          + (f", or make every sample fit {budget} tokens: {' or '.join(fits)}" if fits else ""))
    return lengths


__all__ = ["SOURCES", "auto_micro_batch_tokens", "DataSource", "Dataset", "build_task", "check_data", "open_dataset", "prepare_data",
           "register_source", "source_for"]
