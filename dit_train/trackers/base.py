"""What a tracker is told, and the table of trackers `train.loggers` picks from."""
from __future__ import annotations

import importlib.util
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from PIL import Image

from dit_train.registry import Registry


@dataclass
class Clip:
    """One validation clip, as every tracker may want it."""

    frames: np.ndarray  # uint8 [F, H, W, 3]
    fps: float
    caption: str = ""
    path: Path | None = None  # the mp4 already written for it (trackers that upload files use it)

    def gif(self) -> bytes:
        """The clip as an animated GIF (Pillow alone: no video encoder needed)."""
        images = [Image.fromarray(f) for f in self.frames]
        buf = io.BytesIO()
        images[0].save(buf, format="GIF", save_all=True, append_images=images[1:],
                       duration=int(1000 / max(self.fps, 1)), loop=0)
        return buf.getvalue()


@dataclass
class TrackedRun:
    """What a tracker needs to know about the run it follows (the whole config only as data)."""

    run_dir: Path
    run_id: str  # run.json's id: kept by every resume of the run (run_folder.py)
    start_step: int  # > 0 when resuming: steps from here on were maybe logged before and are logged again
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, plain data

    @property
    def name(self) -> str:
        return self.run_dir.name


class Tracker:
    """One experiment tracker. Only rank 0 opens one, so no method has to think about ranks.

    Steps are the optimizer step of the record (0-based), the same number metrics.jsonl holds."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Finite scalars named by `scalar_tags` (`train/loss`, `eval/...`)."""

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        """uint8 [H, W, 3] images by tag (`samples/grid`)."""

    def log_videos(self, clips: dict[str, Clip], step: int) -> None:
        """Validation clips by tag (`samples/<key>`)."""

    def close(self, ok: bool = True) -> None:
        """Flush and release; `ok=False`: the run failed (a tracker may mark it so)."""


@dataclass(frozen=True)
class TrackerSpec:
    name: str
    # opens the tracker for a run; `train_cfg` is the `train` node (its tracker keys)
    open: Callable[[TrackedRun, Any], Tracker]
    package: str = ""  # the module it imports when it is not a core dependency
    extra: str = ""  # the pyproject extra that installs that module
    records_config: bool = False  # it stores the whole config (TrackedRun.config); else that stays empty

    def missing(self) -> str | None:
        """How to install what this tracker needs, or None when it is there."""
        if not self.package or importlib.util.find_spec(self.package) is not None:
            return None
        return f"pip install 'dit_train[{self.extra}]' (or pip install {self.package})"


TRACKERS: Registry[TrackerSpec] = Registry("tracker")


def register_tracker(spec: TrackerSpec) -> TrackerSpec:
    return TRACKERS.register(spec.name, spec)


def scalar_tags(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's finite numbers by tracker tag: `train/<key>`, except keys that already
    name their group (`eval/...`); `step` is the step, not a metric."""
    return {(k if "/" in k else f"train/{k}"): v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
