"""TensorBoard: event files under <run folder>/tb/ (`tensorboard --logdir outputs`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from dit_train.trackers.base import Clip, TrackedRun, Tracker, TrackerSpec, register_tracker


class TensorBoardTracker(Tracker):
    """Scalars, the validation grid as an image and each clip as an animated GIF in the image tab
    (add_video would need moviepy)."""

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter  # deferred: only train.loggers=[tensorboard] needs it

        # purge_step: TensorBoard hides the events of steps >= start written by the interrupted
        # run, so replayed steps show once
        self.writer = SummaryWriter(log_dir=str(run.run_dir / "tb"),
                                    purge_step=run.start_step if run.start_step > 0 else None)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        for tag, image in images.items():
            self.writer.add_image(tag, image, step, dataformats="HWC")

    def log_videos(self, clips: dict[str, Clip], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # deferred: only train.loggers=[tensorboard] needs it

        for tag, clip in clips.items():
            F, H, W, _ = clip.frames.shape
            image = Summary.Image(height=H, width=W, colorspace=3, encoded_image_string=clip.gif())
            self.writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def close(self, ok: bool = True) -> None:
        self.writer.close()


def _open(run: TrackedRun, train_cfg: Any) -> Tracker:
    return TensorBoardTracker(run)


register_tracker(TrackerSpec("tensorboard", _open))
