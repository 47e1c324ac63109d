"""Tasks glue a data source, an objective and a model into per-token losses on packs: the
mode's task (video: `VideoTask`, llm: `LMTask`) wraps the dataset a source opens, and is what
the step planner and the trainer use (`lengths()`, `build(ids, step)`). `check_data` says,
before training, whether the data can fill a step, each sample fit a micro-batch and the samples
train the run as asked (enough of them kept, long enough for the conditioning, weighing
something under their masks), and `resolve_config` sizes train.micro_batch_tokens=0 (auto) by it."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from dit_train.config import Config
from dit_train.config.errors import ConfigError
from dit_train.config.schema import AUTO_MICRO_BATCH_TOKENS
from dit_train.config.cond import companions
from dit_train.data_pipelines import SOURCES, data_location, open_dataset, source_for
from dit_train.data_pipelines.packing import data_fingerprint
from dit_train.data_pipelines.records import left_out_error
from dit_train.tasks.llm import LMTask
from dit_train.tasks.video import VideoTask

log = logging.getLogger(__name__)


def build_task(mode: str, data: Any, model: Any, loss: Any, seed: int, split: str = "train", cond: Any = None) -> Any:
    """The task of `mode` over the configured data (`split="heldout"` for evaluation data;
    None when the source has no held-out part)."""
    src = SOURCES[data.name]
    if src.mode != mode:
        raise ValueError(f"data={data.name} is a source for mode={src.mode}, not mode={mode}")
    ds = open_dataset(data, model, split, companions(data, cond) if mode == "video" else ())
    if ds is None:
        return None
    if mode == "video":
        # held-out clips are scored with their captions (no dropout), fixed noise and times
        dropout = data.caption_dropout if split == "train" else 0.0
        return VideoTask(ds, model, loss, seed, caption_dropout=dropout, cond=cond, masks=getattr(data, "masks", False))
    return LMTask(ds)


def auto_micro_batch_tokens(lengths: list[int]) -> int:
    """train.micro_batch_tokens=0: the longest sample, at least AUTO_MICRO_BATCH_TOKENS."""
    return max(max(lengths, default=0), AUTO_MICRO_BATCH_TOKENS)


def check_data(cfg: Any) -> list[int]:
    """Fail before training if the data cannot fill a step, a sample cannot fit a micro-batch or
    the samples cannot train the run as asked (check_samples; each error names the keys and
    values that would work). Returns the samples' lengths (what
    the step plan is made from, and what resolve_config sizes train.micro_batch_tokens=0 by);
    `cfg` is only read."""
    return checked_data(cfg)[0]


def checked_data(cfg: Any) -> tuple[list[int], dict[str, object]]:
    """check_data's checks; returns the lengths and the data's fingerprint (data_fingerprint)."""
    try:
        task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
        lengths = task.lengths()
        check_samples(cfg, task, len(lengths))
    except (ValueError, OSError) as err:  # data that cannot be read (a missing corpus, a bad file): one line
        raise ConfigError(str(err)) from err
    if len(lengths) < cfg.train.global_batch:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is larger than the dataset "
                          f"({len(lengths)} samples); set train.global_batch={len(lengths)} (the largest that "
                          f"fits) or add data")
    longest = max(lengths)
    budget = cfg.train.micro_batch_tokens
    if budget == 0 and longest > AUTO_MICRO_BATCH_TOKENS:  # the budget follows the data: say so (memory grows with it)
        log.info("train.micro_batch_tokens=0 (auto): %d tokens, the longest sample", longest)
    if budget and longest > budget:  # (auto fits the longest sample by construction)
        source = source_for(cfg.data, cfg.model)
        which = source.describe(task.dataset, lengths.index(longest))
        fits = source.fitting_keys(task.dataset, budget)
        raise ConfigError(f"the longest sample has {longest} tokens{f' ({which})' if which else ''} but "
                          f"train.micro_batch_tokens={budget}; raise train.micro_batch_tokens to at least {longest} "
                          f"(or 0 = auto: the longest sample)"
                          + (f", or make every sample fit {budget} tokens: {' or '.join(fits)}" if fits else ""))
    return lengths, data_fingerprint(task.dataset, lengths)


def check_samples(cfg: Any, task: Any, kept: int) -> None:
    """ValueError when the `kept` samples of `task` cannot train the run as asked: more clips left
    out while the dataset was built than data.max_dropped_fraction allows (they count like clips
    that fail to decode later; a corpus's bad lines do not: records.py, one bad record never stops
    a run), then the task's own check (VideoTask.check_samples: no sample long enough for its
    conditioning, every mask zero), which may read samples."""
    if cfg.mode == "video":
        left_out = left_out_error(kept, list(getattr(task.dataset, "skipped", [])), cfg.data.max_dropped_fraction,
                                  data_location(cfg.data))
        if left_out:
            raise ValueError(left_out)
    if hasattr(task, "check_samples"):
        source = source_for(cfg.data, cfg.model)
        task.check_samples(lambda i: source.is_still(task.dataset, i))


def resolve_config(cfg: Config, lengths: list[int]) -> Config:
    """The config a run trains with: `cfg` with train.micro_batch_tokens=0 (auto) replaced by the
    budget the data's `lengths` need (auto_micro_batch_tokens). A copy: a composed config is read,
    never changed. `python -m dit_train` resolves once, before any worker starts, and the run
    folder's config.yaml and the checkpoints record that copy; build_run resolves the same way
    for callers that start no workers (the session API, tests)."""
    if cfg.train.micro_batch_tokens:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_tokens=auto_micro_batch_tokens(lengths)))


__all__ = ["auto_micro_batch_tokens", "build_task", "check_data", "resolve_config"]
