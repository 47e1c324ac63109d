"""`data=synthetic_video`: the embedded clips of moving shapes, and optionally still images of
the same world (generated on first use)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from dit_train.data_pipelines.shapes_metric import score_clips
from dit_train.data_pipelines.shapes_sound_metric import heldout_event_clips
from dit_train.data_pipelines.source import register_source
from dit_train.data_pipelines.synthetic_video import dataset_dir, ensure_synthetic_videos
from dit_train.data_pipelines.video_dataset import manifest_entries
from dit_train.data_pipelines.video_source import PixelVideoSource, VideoReadConfig


@dataclass
class SyntheticVideoConfig(VideoReadConfig):
    name: str = "synthetic_video"
    num_clips: int = 48
    gen_seed: int = 1234
    # sizes of the generated clips: each clip draws a width (multiples of 32, for decord), a
    # height and a frame count in [frames[0], frames[1]]; other values get their own cache dir
    widths: List[int] = field(default_factory=lambda: [32, 64, 96])
    heights: List[int] = field(default_factory=lambda: [32, 48, 64])
    frames: List[int] = field(default_factory=lambda: [4, 24])
    # still PNG images of shapes trained next to the clips (one frame each; 0 = clips only)
    num_images: int = 0
    # the 48 compositions tools.evaluate --heldout scores (synthetic_video.caption_split) are in
    # no clip: the clips cycle through the other 208; false: every clip draws its own of all 256
    heldout_compositions: bool = True


@register_source
class SyntheticVideoSource(PixelVideoSource):
    name = "synthetic_video"
    config = SyntheticVideoConfig

    def directory(self) -> Path:
        c = self.cfg
        return dataset_dir(c.cache_dir, c.num_clips, c.gen_seed, c.num_images, c.widths, c.heights, c.frames,
                           c.heldout_compositions, c.audio)

    def prepare(self) -> None:
        super().prepare()
        c = self.cfg
        # data.audio: the same clips with the world's sound (data_pipelines/synthetic_video.py)
        ensure_synthetic_videos(c.cache_dir, c.num_clips, c.gen_seed, c.num_images, c.widths, c.heights, c.frames,
                                c.heldout_compositions, c.audio)

    def score(self, pixels: list, captions: list[str]) -> dict[str, float]:
        """The shapes world's exact metric (data_pipelines/shapes_metric.py)."""
        return score_clips(pixels, captions)

    def sync_events(self) -> list:
        """Clips of the 48 held-out compositions and the frames their shape touches a wall
        (shapes_sound_metric.heldout_event_clips), where the world's sound clicks."""
        return heldout_event_clips()

    def cache_settings(self) -> dict:
        settings = {**super().cache_settings(), "num_clips": self.cfg.num_clips, "gen_seed": self.cfg.gen_seed}
        if self.cfg.num_images:  # only when set: caches written before images existed keep their fingerprint
            settings["num_images"] = self.cfg.num_images
        if self.cfg.heldout_compositions:  # likewise for caches of sets written before the split
            settings["heldout_compositions"] = True
        if self.cfg.audio:
            settings["audio"] = True
        return settings

    def entries(self) -> tuple[list, list]:
        return manifest_entries(self.directory() / "manifest.jsonl")
