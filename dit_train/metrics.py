"""Run outputs of rank 0: metrics.jsonl, the progress bar, and the experiment trackers it feeds
(TensorBoard, W&B, ...: dit_train/trackers)."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from dit_train.atomic import write_atomic
from dit_train.trackers import Clip, Tracker, scalar_tags

log = logging.getLogger(__name__)


class MetricsLogger:
    """Writes one JSON object per optimizer step and hands its scalars to every tracker.

    Only the main rank creates one (`enabled=False` elsewhere makes every call a no-op), so
    ranks never race on a file. It owns the trackers it is given and closes them.
    """

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, enabled: bool = True,
                 progress: bool = True, log_every: int = 10, trackers: Sequence[Tracker] = ()):
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self.trackers = list(trackers) if enabled else []
        self._bar = None
        self._file = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        if start_step > 0 and path.exists():
            drop_rows_from(path, start_step)  # steps replayed after a resume are logged once
        # append: a resumed run continues the same file
        self._file = path.open("a", buffering=1)
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(strict_json(record)) + "\n")
        step = record["step"]
        metrics = scalar_tags(record)
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):.0f}",
                                  gnorm=f"{record.get('grad_norm', float('nan')):.3f}", refresh=False)
        elif step % self.log_every == 0:
            print(f"step {step}: loss {record['loss']:.4f}  grad_norm {record.get('grad_norm', float('nan')):.3f}  "
                  f"{record.get('tokens_per_s', 0):.0f} tok/s", flush=True)

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_images(images, step)

    def log_videos(self, clips: dict[str, Clip], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_videos(clips, step)

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self, ok: bool = True) -> None:
        """`ok=False`: the run failed (trackers that can mark a run failed do)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        for tracker in self.trackers:
            try:
                tracker.close(ok)
            except Exception as err:  # the run's outcome stands; what could not be flushed is named
                log.warning("%s could not be closed: %s: %s", type(tracker).__name__, type(err).__name__, err)
        self._file.close()


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/Infinity: non-finite numbers become null and are listed under "nonfinite"."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


def drop_rows_from(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without the rows of steps >= `step` (atomic: a reader never sees half)."""
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a crash
    text = "".join(line + "\n" for line in keep)
    write_atomic(path, lambda tmp: tmp.write_text(text))  # a failed write leaves the old file and no stray one


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; for a step logged twice (a restart), the last one wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]
