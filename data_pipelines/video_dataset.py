"""A dataset of video clips with known token counts.

Token counts are computed from the file's metadata (frames, size) without decoding, so the
step planner can pack a whole global batch before any pixel is read. Decoded clips are kept
in a small LRU cache: the embedded set is tiny and is read every epoch.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from data_pipelines.video_io import VideoInfo, VideoReadError, frame_indices, probe, read_frames, to_model_range

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClipEntry:
    path: str
    caption: str
    info: VideoInfo


@dataclass
class VideoSample:
    # [C, F, H, W], F/H/W multiples of the patch: pixels in [-1, 1] (C = 3) for video sources,
    # normalized VAE latents (C = latent channels) for latent_cache
    pixels: torch.Tensor
    caption: str
    # caption embedding [Lt, text_dim] float32, valid tokens only (Lt varies per sample);
    # None when the source has no encoded captions (raw videos)
    text_emb: torch.Tensor | None = None


def read_manifest(path: Path) -> list[dict]:
    """Rows of a .jsonl or .csv manifest (columns: path, caption[, frames, height, width, fps])."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".csv":
        import csv

        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"manifest {path} must be .jsonl or .csv")


def manifest_entries(manifest: Path) -> tuple[list[ClipEntry], list[tuple[str, str]]]:
    """(entries, skipped) of a manifest; rows without size metadata are probed with decord,
    and files that cannot be opened are skipped and counted as (path, why)."""
    root = manifest.parent
    entries, bad = [], []
    for row in read_manifest(manifest):
        path = str((root / row["path"]).resolve()) if not Path(row["path"]).is_absolute() else row["path"]
        try:
            if all(row.get(k) not in (None, "") for k in ("frames", "height", "width")):
                info = VideoInfo(int(row["frames"]), int(row["height"]), int(row["width"]), float(row.get("fps") or 0))
            else:
                info = probe(path)
        except (VideoReadError, ValueError) as err:
            bad.append((path, str(err)))
            continue
        entries.append(ClipEntry(path, str(row.get("caption", "")), info))
    if not entries:
        raise ValueError(f"no readable clip in {manifest} ({len(bad)} unreadable)")
    return entries, bad


def _target_size(h: int, w: int, patch_hw: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    if buckets:
        # closest aspect ratio, ties to the larger area
        return min(buckets, key=lambda b: (abs(b[0] / b[1] - h / w), -b[0] * b[1]))
    return h - h % patch_hw[0], w - w % patch_hw[1]


class VideoClipDataset:
    """Clips -> VideoSample; `num_tokens(i)` without decoding.

    patch: (pt, ph, pw). Frames: resampled to `fps` (0 = native), every `frame_stride`-th,
    at most `max_frames`, a multiple of pt. Size: resized to the nearest resolution bucket,
    or centre-cropped to a multiple of (ph, pw) when there are no buckets.
    """

    def __init__(self, entries: list[ClipEntry], patch: tuple[int, int, int], max_frames: int = 16,
                 frame_stride: int = 1, fps: float = 0.0, buckets: list[tuple[int, int]] | None = None,
                 cache_items: int = 256):
        self.patch = tuple(patch)
        self.max_frames, self.frame_stride, self.fps = max_frames, frame_stride, fps
        self.buckets = [tuple(b) for b in (buckets or [])]
        self.cache_items = cache_items
        self._cache: OrderedDict[int, VideoSample] = OrderedDict()
        self._lock = threading.Lock()  # background decode threads (data.num_workers) share the cache
        self.entries: list[ClipEntry] = []
        self.skipped: list[tuple[str, str]] = []  # (path, why) of clips left out
        for e in entries:
            why = self._unusable(e)
            if why:
                self.skipped.append((e.path, why))
            else:
                self.entries.append(e)
        if self.skipped:
            log.warning("skipped %d unusable clip(s), e.g. %s: %s", len(self.skipped), *self.skipped[0])
        if not self.entries:
            raise ValueError("the video dataset has no usable clip" +
                             (f" ({len(self.skipped)} skipped, e.g. {self.skipped[0][0]}: {self.skipped[0][1]})" if self.skipped else ""))

    @classmethod
    def from_manifest(cls, manifest: Path, **kw) -> "VideoClipDataset":
        """The clips of a manifest (see `manifest_entries`)."""
        entries, bad = manifest_entries(manifest)
        ds = cls(entries, **kw)
        ds.skipped = bad + ds.skipped
        return ds

    # -- geometry ---------------------------------------------------------------------------

    def _indices(self, e: ClipEntry) -> list[int]:
        return frame_indices(e.info.frames, e.info.fps, self.fps, self.frame_stride, self.max_frames, self.patch[0])

    def _unusable(self, e: ClipEntry) -> str:
        if not self._indices(e):
            return f"fewer frames ({e.info.frames}) than one temporal patch ({self.patch[0]}) after striding"
        h, w = _target_size(e.info.height, e.info.width, self.patch[1:], self.buckets)
        if h < self.patch[1] or w < self.patch[2]:
            return f"smaller ({e.info.height}x{e.info.width}) than one patch {self.patch[1:]}"
        return ""

    def __len__(self) -> int:
        return len(self.entries)

    def num_tokens(self, i: int) -> int:
        e = self.entries[i]
        h, w = _target_size(e.info.height, e.info.width, self.patch[1:], self.buckets)
        pt, ph, pw = self.patch
        return len(self._indices(e)) // pt * (h // ph) * (w // pw)

    def lengths(self) -> list[int]:
        return [self.num_tokens(i) for i in range(len(self))]

    # -- decoding ---------------------------------------------------------------------------

    def __getitem__(self, i: int) -> VideoSample:
        with self._lock:
            if i in self._cache:
                self._cache.move_to_end(i)
                return self._cache[i]
        e = self.entries[i]
        frames = read_frames(e.path, self._indices(e), e.info)  # uint8 [F, H, W, 3]
        x = to_model_range(frames)  # [3, F, H, W]
        h, w = _target_size(e.info.height, e.info.width, self.patch[1:], self.buckets)
        x = _resize_crop(x, h, w, resize=bool(self.buckets))
        sample = VideoSample(x, e.caption)
        if self.cache_items > 0:
            with self._lock:
                self._cache[i] = sample
                if len(self._cache) > self.cache_items:
                    self._cache.popitem(last=False)
        return sample


def _resize_crop(x: torch.Tensor, h: int, w: int, resize: bool) -> torch.Tensor:
    """[C, F, H, W] -> [C, F, h, w]: optionally scale so the frame just covers (h, w), then
    centre-crop. Without `resize` (no buckets) the crop only trims the patch remainder."""
    _, _, H, W = x.shape
    if resize and (H, W) != (h, w):
        scale = max(h / H, w / W)
        nh, nw = max(h, round(H * scale)), max(w, round(W * scale))
        x = F.interpolate(x.transpose(0, 1), size=(nh, nw), mode="bilinear", antialias=True,
                          align_corners=False).transpose(0, 1)
        H, W = nh, nw
    top, left = (H - h) // 2, (W - w) // 2
    return x[:, :, top:top + h, left:left + w].contiguous()
