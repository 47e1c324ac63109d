"""Pixel video sources (the embedded clips, your folders): decoding settings they share."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from dit_train.config.choices import Mode, VideoDecoder
from dit_train.config.schema import DataConfig
from dit_train.data_pipelines.records import in_heldout
from dit_train.data_pipelines.sizes import fitting_buckets, fitting_max_frames, slab_tokens
from dit_train.data_pipelines.source import DataSource
from dit_train.data_pipelines.video_dataset import VideoClipDataset
from dit_train.data_pipelines.video_io import is_image, use_decoder

log = logging.getLogger(__name__)

@dataclass
class VideoReadConfig(DataConfig):
    """How clips are read: frames resampled to `fps` (0 = native), every `frame_stride`-th, at
    most `max_frames` (cut to a multiple of the temporal patch); a still image is its one frame
    repeated to fill one temporal patch (fps / stride / max_frames do not apply); sizes, of
    images and videos alike, go to the closest `resolution_buckets` entry ([[h, w], ...]: resized
    to cover it, centre-cropped) or, with null / [] (the embedded set), stay native (cropped to
    the patch). `data=video_folder` defaults to the model preset's `model.default_buckets`.
    `decoder` reads the videos (auto: decord where it is installed, else PyAV; all return the
    same frames, see data_pipelines/video_readers.py)."""

    max_frames: int = 16
    frame_stride: int = 1
    fps: float = 0.0
    resolution_buckets: Optional[List[List[int]]] = field(default_factory=list)
    decoded_cache_items: int = 256  # decoded clips kept in memory (the embedded set fits)
    decoder: VideoDecoder = VideoDecoder.auto  # auto | decord | pyav | torchcodec
    # each clip's sound (VideoSample.audio: mono, 16 kHz, the span of the kept frames) read with
    # PyAV from the manifest's `audio` file or the clip itself; clips without usable sound stay
    # video-only (docs/audio-video.md). Trains the two-stream DiT (model.audio_patch > 0)
    audio: bool = False


class PixelVideoSource(DataSource):
    """A source of RGB clips (and stills) in [-1, 1]; subclasses say where the clip entries come from."""

    mode = Mode.video
    companion_kinds = ("mask", "control")

    def prepare(self) -> None:
        """Pick the video reader (data.decoder) and say which, once, before any file is probed;
        a reader that cannot be imported here is refused (ValueError naming data.decoder)."""
        log.info(use_decoder(self.cfg.decoder))

    def entries(self) -> tuple[list, list]:
        """(ClipEntry list, skipped (path, why) list) of the source."""
        raise NotImplementedError

    def cache_settings(self) -> dict:
        """What decides which clips a latent cache of this source holds, and how they are read
        (part of the cache's fingerprint: tools/cache_latents.py)."""
        c = self.cfg
        return {"name": c.name, "max_frames": c.max_frames, "frame_stride": c.frame_stride, "fps": c.fps,
                "resolution_buckets": [list(b) for b in c.resolution_buckets or []]}

    def make_dataset(self, entries: list, **kw: Any) -> VideoClipDataset:
        """The dataset class over `entries` (keywords: VideoClipDataset's); shards read theirs from tars."""
        return VideoClipDataset(entries, **kw)

    def pixel_dataset(self, patch: tuple[int, int, int], cache_items: int | None = None, split: str = "") -> Any:
        """The clips as a VideoClipDataset cropping frames to multiples of patch[0] and sizes
        to multiples of patch[1:] (or buckets). Clips that cannot be read or are too small are
        left out and listed in `.skipped`. split: "" = every clip, "train" / "heldout" = one side
        of the data.heldout_fraction split (by each file's name)."""
        c = self.cfg
        use_decoder(c.decoder)  # this process's reader (workers run open(), not prepare())
        entries, skipped = self.entries()
        if split:
            entries = [e for e in entries if in_heldout(Path(e.path).name, c.heldout_fraction) == (split == "heldout")]
            if not entries:
                raise ValueError(f"data.heldout_fraction={c.heldout_fraction} leaves no {split} clip; "
                                 f"{'lower' if split == 'train' else 'raise'} it")
        ds = self.make_dataset(entries, patch=tuple(patch), max_frames=c.max_frames, frame_stride=c.frame_stride,
                               fps=c.fps, buckets=[tuple(b) for b in c.resolution_buckets or []],
                               cache_items=c.decoded_cache_items if cache_items is None else cache_items,
                               companions=self.companions, audio=c.audio)
        ds.skipped = skipped + ds.skipped
        return ds

    def is_still(self, dataset: Any, i: int) -> bool:
        return hasattr(dataset, "entries") and is_image(dataset.entries[i].path)

    def fps(self, dataset: Any, i: int) -> float:
        """The resampling rate (data.fps; a slower clip keeps its own) or the clip's native rate,
        divided by the stride."""
        entry = dataset.entries[i] if hasattr(dataset, "entries") else None
        native = entry.info.fps if entry is not None and entry.info.fps > 0 else 8.0
        rate = min(self.cfg.fps, native) if self.cfg.fps > 0 else native
        return rate / max(1, self.cfg.frame_stride)

    def describe(self, dataset: Any, i: int) -> str:
        """`<file>: <frames> frames at <h>x<w> (native <h>x<w>)`."""
        ds = getattr(dataset, "dataset", dataset)  # through the background prefetcher
        e = ds.entries[i]
        (h, w), native = ds.size(i), (e.info.height, e.info.width)
        size = f"{h}x{w}" + (f" (native {native[0]}x{native[1]})" if (h, w) != native else "")
        return f"{e.path}: {ds.frames(i)} frames at {size}"

    def fitting_keys(self, dataset: Any, budget: int) -> list[str]:
        """A data.max_frames (sizes kept) and a data.resolution_buckets (frames kept) with which
        every clip fits `budget`; the buckets are the current ones scaled down, or, for native
        sizes, the model preset's model.default_buckets (scaled down if need be)."""
        ds = getattr(dataset, "dataset", dataset)
        pt, ph, pw = ds.patch
        slabs = [ds.frames(i) // pt for i in range(len(ds))]
        per = [slab_tokens(ds.size(i), (ph, pw)) for i in range(len(ds))]
        keys = []
        start = ds.buckets or [tuple(b) for b in getattr(self.model_cfg, "default_buckets", None) or []]
        natives = [(e.info.height, e.info.width) for e in ds.entries]
        buckets = fitting_buckets(natives, slabs, (ph, pw), budget, start) if start else None
        if buckets:
            keys.append("'data.resolution_buckets=[" + ",".join(f"[{h},{w}]" for h, w in buckets) + "]'")
        frames = fitting_max_frames(slabs, per, pt, budget)
        if frames:
            keys.append(f"data.max_frames={frames}")
        return keys

    def open(self, split: str = "train") -> Any:
        """The clips of `split`: "heldout" = those whose file name hashes under
        data.heldout_fraction (None when the fraction is 0), "train" = the rest."""
        if self.model_cfg.in_channels != 3:
            raise ValueError(f"data={self.name} gives RGB pixels but model.in_channels={self.model_cfg.in_channels}; "
                             f"set model.in_channels=3 (or train on data=latent_cache)")
        if split != "train" and self.cfg.heldout_fraction <= 0:
            return None
        return self.pixel_dataset(tuple(self.model_cfg.patch_size), split=split)
