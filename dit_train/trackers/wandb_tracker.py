"""Weights & Biases: one W&B run per run folder, continued by every resume of it.

- id: run.json's run id (kept by every resume, run_folder.py: also one from another folder's
  checkpoint), passed with `resume="allow"`, so a resumed run logs into the same W&B run, and a
  new run (`train.overwrite`, a fresh folder) into a new one; name: the run folder's name;
  config: the resolved config; files: under `<run folder>/wandb/`.
- `train.wandb_mode=auto`: online when W&B credentials are configured (`wandb login`, or
  wandb's own settings) and its server answers, else offline (`auto` never prompts).
- offline: each launch writes `<run folder>/wandb/offline-run-<time>-<id>/` (same id);
  `wandb beta sync <run folder>/wandb` (wandb 0.31) uploads them, the fragments of one resumed
  run one after the other in order of start time (older `wandb sync` did not append fragments).
- replayed steps: a resume from an older checkpoint trains again steps the interrupted launch
  may have logged. W&B cannot delete logged steps, and it ignores (with a warning) a step lower
  than the run's current one: on W&B those steps keep the first launch's values, while
  metrics.jsonl and TensorBoard hold the replayed ones.
"""
from __future__ import annotations

import inspect
import io
import socket
from typing import Any
from urllib.parse import urlparse

import numpy as np

from dit_train.config.errors import ConfigError
from dit_train.trackers.base import Clip, TrackedRun, Tracker, TrackerSpec, register_tracker


def choose_mode(mode: str, has_credentials: bool, reachable: bool) -> str:
    """The mode wandb.init gets: `auto` is online only with credentials and a server that answers."""
    if mode != "auto":
        return mode
    return "online" if has_credentials and reachable else "offline"


def _has_credentials() -> bool:
    """W&B finds credentials (its environment, settings files, .netrc) without asking anyone."""
    import wandb  # deferred: optional (the wandb extra), ~0.4 s to import

    if "prompt" in inspect.signature(wandb.login).parameters:  # recent wandb: wandb.api is deprecated
        return bool(wandb.login(prompt=False, verify=False))
    return bool(wandb.api.api_key)  # older wandb (0.17 has no prompt=)


def _reachable(base_url: str, timeout_s: float = 3.0) -> bool:
    """The W&B server accepts a TCP connection (no request is sent)."""
    url = urlparse(base_url)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
        return True
    except (OSError, TypeError):
        return False


class WandbTracker(Tracker):
    """Metrics as they are tagged, the grid as a wandb.Image and the clips as wandb.Video: the
    mp4 files the run already wrote (no encoder needed), or GIFs for clips without one."""

    def __init__(self, run: TrackedRun, project: str, mode: str):
        import wandb  # deferred: optional (the wandb extra), ~0.4 s to import

        if mode == "auto":
            has_key = _has_credentials()
            mode = choose_mode(mode, has_key, has_key and _reachable(wandb.setup().settings.base_url))
        self.mode = mode
        try:
            self.run = wandb.init(project=project, name=run.name, id=run.run_id or None, resume="allow",
                                  dir=str(run.run_dir), config=run.config, mode=mode)
        except wandb.errors.Error as err:  # no API key, a key the server refuses, no server: before step 0

            raise ConfigError(f"train.loggers has wandb, but W&B could not start the run (train.wandb_mode={mode}): "
                              f"{err}; log in with `wandb login`, or set train.wandb_mode=offline (upload the run "
                              f"later with `wandb beta sync {run.run_dir}/wandb`)") from err

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # several calls with the same step make one W&B row (it is sent when a later step comes)
        self.run.log(dict(metrics), step=step)

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        import wandb  # deferred: optional (the wandb extra), ~0.4 s to import

        self.run.log({tag: wandb.Image(image) for tag, image in images.items()}, step=step)

    def log_videos(self, clips: dict[str, Clip], step: int) -> None:
        import wandb  # deferred: optional (the wandb extra), ~0.4 s to import

        def video(c: Clip) -> Any:
            if c.path is not None:
                return wandb.Video(str(c.path), caption=c.caption or None)
            return wandb.Video(io.BytesIO(c.gif()), caption=c.caption or None, format="gif")

        self.run.log({tag: video(c) for tag, c in clips.items()}, step=step)

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)  # a failed run shows as failed


def _open(run: TrackedRun, train_cfg: Any) -> Tracker:
    return WandbTracker(run, train_cfg.wandb_project, str(train_cfg.wandb_mode))


register_tracker(TrackerSpec("wandb", _open, package="wandb", extra="wandb", records_config=True))
