"""`data=video_folder`: your videos and still images (a folder tree with .txt captions, or a
csv/jsonl manifest); an image trains as a one-frame clip (see VideoClipDataset)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dit_train.data_pipelines.source import register_source
from dit_train.data_pipelines.video_folder import index_video_folder
from dit_train.data_pipelines.video_source import PixelVideoSource, VideoReadConfig


@dataclass
class VideoFolderConfig(VideoReadConfig):
    name: str = "video_folder"
    root: str = ""  # a folder (searched recursively) or a .csv/.jsonl manifest; videos and images mix


@register_source
class VideoFolderSource(PixelVideoSource):
    name = "video_folder"
    config = VideoFolderConfig

    def prepare(self) -> None:
        """Probe every file once (workers then read the index instead of probing)."""
        super().prepare()
        index_video_folder(self.cfg.root, self.cfg.cache_dir, self.cfg.num_workers)

    def cache_settings(self) -> dict:
        return {**super().cache_settings(), "root": str(Path(self.cfg.root).expanduser().resolve())}

    def entries(self) -> tuple[list, list]:
        root = self.cfg.root  # "" is refused by the data layer with the key to set
        index = index_video_folder(root, self.cfg.cache_dir, self.cfg.num_workers)
        if not index.entries:
            raise ValueError(f"no readable video or image under data.root={root} ({len(index.skipped)} unreadable, "
                             f"e.g. {index.skipped[0][0]}: {index.skipped[0][1]})")
        return index.entries, list(index.skipped)
