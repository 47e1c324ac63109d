"""`data=synthetic_video`: the embedded clips of moving shapes, and optionally still images of
the same world (generated on first use)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dit_train.data.source import register_source
from dit_train.data.video import PixelVideoSource, VideoReadConfig


@dataclass
class SyntheticVideoConfig(VideoReadConfig):
    name: str = "synthetic_video"
    num_clips: int = 48
    gen_seed: int = 1234
    # still PNG images of shapes trained next to the clips (one frame each; 0 = clips only)
    num_images: int = 0


@register_source
class SyntheticVideoSource(PixelVideoSource):
    name = "synthetic_video"
    config = SyntheticVideoConfig

    def directory(self) -> Path:
        from data_pipelines.synthetic_video import dataset_dir

        return dataset_dir(self.cfg.cache_dir, self.cfg.num_clips, self.cfg.gen_seed, self.cfg.num_images)

    def prepare(self) -> None:
        from data_pipelines.synthetic_video import ensure_synthetic_videos

        ensure_synthetic_videos(self.cfg.cache_dir, self.cfg.num_clips, self.cfg.gen_seed, self.cfg.num_images)

    def score(self, pixels: list, captions: list[str]) -> dict[str, float]:
        """The shapes world's exact metric (data_pipelines/shapes_metric.py)."""
        from data_pipelines.shapes_metric import score_clips

        return score_clips(pixels, captions)

    def entries(self) -> tuple[list, list]:
        from data_pipelines.video_dataset import manifest_entries

        return manifest_entries(self.directory() / "manifest.jsonl")
