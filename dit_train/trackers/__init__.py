"""Experiment trackers: where rank 0 sends a run's metrics and validation media besides
metrics.jsonl (`train.loggers`, default `[tensorboard]`).

Each tracker is a module that registers a `TrackerSpec` in `TRACKERS` (base.py has the
interface): tensorboard_tracker.py (TensorBoard, a core dependency) and wandb_tracker.py
(Weights & Biases, the `wandb` extra). `MetricsLogger` (dit_train/metrics.py) fans every record
out to the open trackers; `write_samples` hands them the validation grid and clips.
"""
from __future__ import annotations

from typing import Any

from dit_train.trackers import tensorboard_tracker, wandb_tracker  # noqa: F401  (register)
from dit_train.trackers.base import TRACKERS, Clip, TrackedRun, Tracker, TrackerSpec, register_tracker, scalar_tags


def open_trackers(train_cfg: Any, run: TrackedRun) -> list[Tracker]:
    """The trackers `train_cfg.loggers` names, opened for `run` (rank 0 only). If one cannot be
    opened, those already open are closed before the error goes on."""
    opened: list[Tracker] = []
    try:
        for name in train_cfg.loggers:
            opened.append(TRACKERS[name].open(run, train_cfg))
    except BaseException:
        for tracker in opened:
            tracker.close(ok=False)
        raise
    return opened


def records_config(loggers: list[str]) -> bool:
    """Whether a tracker of `loggers` stores the whole config: only then is it turned into data
    (`to_dict`, an OmegaConf copy of the tree, ~0.05 CPU-s: a tenth of a tiny run)."""
    return any(TRACKERS[name].records_config for name in loggers)


def tracker_errors(loggers: list[str]) -> list[str]:
    """Config errors of `train.loggers`: unknown names (the message lists the known ones),
    names given twice, trackers whose package is not installed."""
    errors = []
    for name in sorted(set(loggers)):
        if name not in TRACKERS:
            errors.append(f"train.loggers: {name!r} is not a tracker; allowed: {', '.join(TRACKERS.names())}")
        elif (hint := TRACKERS[name].missing()) is not None:
            errors.append(f"train.loggers: {name} needs the {TRACKERS[name].package} package: {hint}")
    twice = sorted({n for n in loggers if list(loggers).count(n) > 1})
    if twice:
        errors.append(f"train.loggers lists {', '.join(twice)} more than once")
    return errors


__all__ = ["TRACKERS", "Clip", "TrackedRun", "Tracker", "TrackerSpec", "open_trackers", "records_config",
           "register_tracker", "scalar_tags", "tracker_errors"]
