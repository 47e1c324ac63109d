"""A dataset of video clips (and still images: clips of one frame) with known token counts.

Token counts are computed from the file's metadata (frames, size) without decoding, so the
step planner can pack a whole global batch before any pixel is read. Decoded clips are kept
in a small LRU cache: the embedded set is tiny and is read every epoch.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from dit_train.data_pipelines.audio_io import SAMPLE_RATE, read_audio
from dit_train.data_pipelines.companions import NONE, Companions, box_frames, missing, none_found, row_companions, row_path
from dit_train.data_pipelines.records import (Skip, decode_utf8, describe, json_kind, normalize_newlines, parsed_once,
                                              unencodable, warn_once)
from dit_train.data_pipelines.sizes import resize_crop, slab_tokens, target_size
from dit_train.data_pipelines.video_io import (VideoInfo, VideoReadError, frame_indices, is_image, probe, read_frames, still_indices,
                                     to_model_range)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClipEntry:
    path: str
    caption: str
    info: VideoInfo
    companions: Companions = NONE  # its mask / control files (data_pipelines/companions.py)
    audio: str = ""  # the manifest's `audio` file (e.g. the embedded world's clip.wav); "" = the clip's own file


@dataclass
class VideoSample:
    # [C, F, H, W], F/H/W multiples of the patch: pixels in [-1, 1] (C = 3) for video sources,
    # normalized VAE latents (C = latent channels) for latent_cache
    pixels: torch.Tensor
    caption: str
    # caption embedding [Lt, text_dim] float32, valid tokens only (Lt varies per sample);
    # None when the source has no encoded captions (raw videos)
    text_emb: torch.Tensor | None = None
    # data.masks: uint8 [F, H, W] loss mask aligned with `pixels` (255 = fully supervised)
    mask: torch.Tensor | None = None
    # cond.control: [3, F, H, W] control video in [-1, 1] aligned with `pixels`
    control: torch.Tensor | None = None
    # latent caches written with --control: the encoding of an all-zero video of the clip's size
    # (Wan VACE's inactive video, models/wan_vace.py); None on pixels, where it is zeros
    control_inactive: torch.Tensor | None = None
    # Wan 2.1 I2V (latent caches written with --i2v, data_pipelines/i2v_cache.py): the VAE
    # encoding of [first frame, zeros...] [C, F, H, W], and the CLIP image tokens [Li, image_dim]
    cond_latents: torch.Tensor | None = None
    image_emb: torch.Tensor | None = None
    # data.audio: float32 [N] mono sound at synthetic_video.SAMPLE_RATE of the time span of the
    # kept frames (data_pipelines/audio_io.py); None = the clip has no usable sound (video only)
    audio: torch.Tensor | None = None
    # a latent cache written with --audio-vae (data_pipelines/audio_latents.py): LTX-2's normalized
    # audio tokens [n, token_dim] of the same span; None = no audio latents (video only)
    audio_latents: torch.Tensor | None = None


MANIFEST_SUFFIXES = (".jsonl", ".csv")


def scan_manifest(path: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """_scan_manifest's (rows, left out), read and parsed once per process while the file is
    unchanged (records.parsed_once): each dataset build of a launch asks again. The lists are
    the caller's; the rows are shared (read them, do not change them)."""
    rows, skipped = parsed_once(path, _scan_manifest)
    return list(rows), list(skipped)


def _scan_manifest(path: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """Usable rows of a .jsonl or .csv manifest (extension in any case), and (`<manifest>:<line>`,
    why) of each row left out (warned about once, with the first few named).

    Columns: path, caption[, frames, height, width, fps, mask, control, mask_boxes] (the last three:
    data_pipelines/companions.py); a path may be a video or a still image
    (video_io.IMAGE_EXTENSIONS), mixed freely. A usable row has a non-empty string `path` and a
    string `caption`; a missing, empty or null caption is the empty caption (the
    clip trains uncaptioned, as a video without a .txt does: null is how pandas writes a missing
    value). Left out: lines that are not UTF-8 or not JSON objects, rows without a path, and a
    path or caption of another type (a number or a list is a column mix-up; its text would be a
    wrong caption, worse than none). Errors (ValueError naming the manifest): another extension,
    a binary file, a CSV without a `path` column, no usable row.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in MANIFEST_SUFFIXES:
        raise ValueError(f"manifest {path} must be .jsonl or .csv")
    try:
        data = normalize_newlines(path.read_bytes())
    except OSError as e:
        raise ValueError(f"manifest {path} cannot be read: {e}") from e
    if b"\x00" in data:
        raise ValueError(f"manifest {path} looks binary (it holds NUL bytes); write it as UTF-8 .csv or .jsonl "
                         f"with columns path, caption")
    numbered = _jsonl_rows(data) if suffix == ".jsonl" else _csv_rows(path, data)
    rows, skipped = [], []
    for line, row in numbered:
        why = row if isinstance(row, str) else _row_problem(row)
        if why:
            skipped.append(Skip(str(path), line, why))
        else:
            rows.append(row)
    if not rows:
        raise ValueError(f"manifest {path} has no usable row" + (f": {describe(skipped, 'row')}" if skipped else "")
                         + '; each row needs a "path" (relative to the manifest\'s folder, or absolute) '
                           'and a "caption"')
    warn_once(log, describe(skipped, "row"))
    return rows, [(f"{s.file}:{s.line}", s.why) for s in skipped]


def read_manifest(path: Path) -> list[dict]:
    """Usable rows of a .jsonl or .csv manifest (see scan_manifest; left-out rows are warned about)."""
    return scan_manifest(path)[0]


def _jsonl_rows(data: bytes) -> list[tuple[int, dict | str]]:
    """(line, row or why it cannot be read) of each non-blank line."""
    out: list[tuple[int, dict | str]] = []
    for i, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        line, bad_at, why = decode_utf8(raw)
        if line is None:
            out.append((i + 1, f"{why} at column {bad_at + 1}"))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            out.append((i + 1, f"not JSON ({e.msg}: column {e.colno})"))
            continue
        out.append((i + 1, row if isinstance(row, dict) else f"not a JSON object ({json_kind(row)})"))
    return out


def _csv_rows(path: Path, data: bytes) -> list[tuple[int, dict | str]]:
    """(line, row or why it cannot be read) of each CSV record. Bytes that are not UTF-8 are
    kept as surrogates while parsing (a record may span lines) and the record holding them is
    left out, not the file."""
    reader = csv.DictReader(io.StringIO(data.decode("utf-8", errors="surrogateescape"), newline=""))
    if "path" not in (reader.fieldnames or []):
        raise ValueError(f"manifest {path} needs a `path` column (and `caption`); it has {reader.fieldnames or []}")
    out: list[tuple[int, dict | str]] = []
    for row in reader:
        row.pop(None, None)  # the surplus cells of a row longer than the header
        bad = next((c for v in row.values() if isinstance(v, str) for c in v if "\udc80" <= c <= "\udcff"), None)
        out.append((reader.line_num, row if bad is None else f"not UTF-8 (byte 0x{ord(bad) - 0xdc00:02x})"))
    return out


def _row_problem(row: dict) -> str:
    """Why a manifest row cannot be used ('' if it can); fills in the empty caption."""
    if "path" not in row or row["path"] is None:
        return 'no "path"'
    if not isinstance(row["path"], str):
        return f'"path" is {json_kind(row["path"])}'
    if not row["path"].strip():
        return '"path" is empty'
    if why := unencodable(row["path"]):
        return f'"path" {why}'
    caption = row.get("caption")
    if caption is None:
        row["caption"] = ""
    elif not isinstance(caption, str):
        return f'"caption" is {json_kind(caption)}'
    elif why := unencodable(caption):
        return f'"caption" {why}'
    return ""


def manifest_entries(manifest: Path) -> tuple[list[ClipEntry], list[tuple[str, str]]]:
    """(entries, skipped) of a manifest: rows without size metadata are probed (videos with
    decord, images from their header). An image has one frame whatever `frames` says, so it
    needs only height and width. Rows that cannot be used (see scan_manifest) and files that
    cannot be opened are skipped and counted as (`<manifest>:<line>` or path, why)."""
    manifest = Path(manifest)
    root = manifest.parent
    rows, bad = scan_manifest(manifest)
    entries = []
    for row in rows:
        path = row_path(root, row["path"])
        still = is_image(path)
        declared = ("height", "width") if still else ("frames", "height", "width")
        try:
            if all(row.get(k) not in (None, "") for k in declared):
                if still:
                    info = VideoInfo(1, int(row["height"]), int(row["width"]), 0.0)
                else:
                    info = VideoInfo(int(row["frames"]), int(row["height"]), int(row["width"]), float(row.get("fps") or 0))
            else:
                info = probe(path)
        except VideoReadError as err:
            bad.append((path, str(err)))
            continue
        except (ValueError, TypeError) as err:  # TypeError: "frames": [8] in a JSON row
            bad.append((path, f"columns frames/height/width/fps are not numbers: {err}"))
            continue
        sound = row.get("audio")
        entries.append(ClipEntry(path, row["caption"], info, row_companions(row, root),
                                 row_path(root, sound) if isinstance(sound, str) and sound else ""))
    if not entries:
        raise ValueError(f"no readable clip in {manifest} ({len(bad)} unreadable)")
    return entries, bad


class VideoClipDataset:
    """Clips -> VideoSample; `num_tokens(i)` without decoding.

    patch: (pt, ph, pw). Frames: resampled to `fps` (0 = native; a clip slower than `fps` keeps
    its own rate), every `frame_stride`-th, at most `max_frames`, a multiple of pt. A still image (video_io.is_image) is its one frame
    repeated pt times (video_io.still_indices: one temporal slab of tokens; fps, stride and
    max_frames do not apply). Size, images and videos alike: resized to cover the resolution
    bucket of the closest aspect ratio and centre-cropped, or cropped to a multiple of (ph, pw)
    when there are no buckets (data_pipelines/sizes.py). `companions` ("mask", "control"): files
    read with each clip through the same frames, resize and crop (VideoSample.mask / .control);
    a clip whose companion is missing or does not match it raises VideoReadError (skipped and
    counted by the task), data where no clip has one is refused (ValueError).
    """

    def __init__(self, entries: list[ClipEntry], patch: tuple[int, int, int], max_frames: int = 16,
                 frame_stride: int = 1, fps: float = 0.0, buckets: list[tuple[int, int]] | None = None,
                 cache_items: int = 256, companions: tuple[str, ...] = (), audio: bool = False):
        self.patch = tuple(patch)
        self.audio = audio
        self.audio_outcomes: Counter[str] = Counter()  # data.audio: audio_io outcomes of the clips read
        self.companions = tuple(companions)
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
        if self.skipped:  # once per process: the data check, the train and held-out splits each build one
            warn_once(log, "skipped %d unusable clip(s), e.g. %s: %s" % (len(self.skipped), *self.skipped[0]))
        self._warn_slow_clips()
        if not self.entries:
            raise ValueError("the video dataset has no usable clip" +
                             (f" ({len(self.skipped)} skipped, e.g. {self.skipped[0][0]}: {self.skipped[0][1]})" if self.skipped else ""))
        for kind in self.companions:
            if not any(e.companions.has(kind) for e in self.entries):
                raise ValueError(none_found(kind))

    @classmethod
    def from_manifest(cls, manifest: Path, **kw) -> "VideoClipDataset":
        """The clips of a manifest (see `manifest_entries`)."""
        entries, bad = manifest_entries(manifest)
        ds = cls(entries, **kw)
        ds.skipped = bad + ds.skipped
        return ds

    # -- geometry ---------------------------------------------------------------------------

    def _indices(self, e: ClipEntry) -> list[int]:
        if is_image(e.path):
            return still_indices(self.patch[0])
        # a clip slower than `fps` is read at its own rate: resampling up would repeat frames
        # (a stutter the model would learn), so no frame is ever taken twice
        target = 0.0 if self.fps > e.info.fps > 0 else self.fps
        return frame_indices(e.info.frames, e.info.fps, target, self.frame_stride, self.max_frames, self.patch[0])

    def _unusable(self, e: ClipEntry) -> str:
        if not self._indices(e):
            return f"fewer frames ({e.info.frames}) than one temporal patch ({self.patch[0]}) after resampling and striding"
        h, w = target_size(e.info.height, e.info.width, self.patch[1:], self.buckets)
        if h < self.patch[1] or w < self.patch[2]:
            return f"smaller ({e.info.height}x{e.info.width}) than one patch {self.patch[1:]}"
        return ""

    def _warn_slow_clips(self) -> None:
        slow = [e for e in self.entries if not is_image(e.path) and self.fps > e.info.fps > 0]
        if slow:
            warn_once(log, f"{len(slow)} clip(s) have fewer frames per second than data.fps={self.fps:g}, e.g. "
                           f"{slow[0].path} at {slow[0].info.fps:g} fps: they are read at their own rate (no frame "
                           f"is repeated)")

    def __len__(self) -> int:
        return len(self.entries)

    def size(self, i: int) -> tuple[int, int]:
        """(height, width) sample i is trained at."""
        e = self.entries[i]
        return target_size(e.info.height, e.info.width, self.patch[1:], self.buckets)

    def frames(self, i: int) -> int:
        """Frames sample i is trained with (a multiple of the temporal patch)."""
        return len(self._indices(self.entries[i]))

    def num_tokens(self, i: int) -> int:
        return self.frames(i) // self.patch[0] * slab_tokens(self.size(i), self.patch[1:])

    def lengths(self) -> list[int]:
        return [self.num_tokens(i) for i in range(len(self))]

    def audio_samples(self, i: int) -> int:
        """Waveform samples (16 kHz) of sample i's sound as planned, without decoding: the span
        of its kept frames when data.audio and its manifest row names an audio file, else 0 (a
        clip's own soundtrack is only known once read: planning counts it as none)."""
        e = self.entries[i]
        if not self.audio or not e.audio or is_image(e.path):
            return 0
        return self.span_samples(i)

    def span_samples(self, i: int) -> int:
        """Waveform samples (16 kHz) of the time span of sample i's kept frames (what `_sound`
        cuts out of its track when the track is long enough)."""
        e = self.entries[i]
        idx = self._indices(e)
        return round((idx[-1] + 1 - idx[0]) / (e.info.fps if e.info.fps > 0 else 8.0) * SAMPLE_RATE)

    def captions(self) -> list[str]:
        """Each sample's caption, in sample order (the resume check's content fingerprint)."""
        return [e.caption for e in self.entries]

    # -- decoding ---------------------------------------------------------------------------

    def read(self, e: ClipEntry, indices: list[int]) -> torch.Tensor:
        """Frames `indices` of clip `e` as uint8 [F, H, W, 3], from its file (shards read theirs
        out of a tar: data_pipelines/shard_datasets.py)."""
        return read_frames(e.path, indices, e.info)

    def __getitem__(self, i: int) -> VideoSample:
        with self._lock:
            if i in self._cache:
                self._cache.move_to_end(i)
                return self._cache[i]
        e = self.entries[i]
        indices = self._indices(e)
        x = self._fit(self.read(e, indices), i)  # [3, F, H, W]
        sample = VideoSample(x, e.caption)
        if "mask" in self.companions:
            m = self._fit(self._mask_frames(e, indices), i, companion=True).mean(0)  # [F, H, W] in [-1, 1]
            sample.mask = m.add(1).mul(127.5).round().clamp(0, 255).to(torch.uint8)
        if "control" in self.companions:
            sample.control = self._fit(self._companion_frames(e, "control", indices), i, companion=True)
        if self.audio and not is_image(e.path):
            sample.audio = self._sound(e, indices)
        if self.cache_items > 0:
            with self._lock:
                self._cache[i] = sample
                if len(self._cache) > self.cache_items:
                    self._cache.popitem(last=False)
        return sample

    def _sound(self, e: ClipEntry, indices: list[int]) -> torch.Tensor | None:
        """float32 [N] sound of the span of frames `indices` (native frame numbers), or None;
        what reading it took is counted in `audio_outcomes` (audio_io.read_audio never raises)."""
        fps = e.info.fps if e.info.fps > 0 else 8.0
        got = read_audio(e.audio or e.path, SAMPLE_RATE, indices[0] / fps, (indices[-1] + 1) / fps, e.info.frames / fps)
        with self._lock:
            self.audio_outcomes.update(got.outcomes)
        return None if got.samples is None else torch.from_numpy(got.samples)

    def _fit(self, frames: torch.Tensor, i: int, companion: bool = False) -> torch.Tensor:
        """uint8 [F, h, w, C] frames of sample i -> float [C, F, H, W] in [-1, 1] at the size sample
        i trains at: the clip's own path (resize to its bucket, centre crop), which a `companion`
        of another size (same aspect) joins after being scaled to the clip's native size."""
        x = to_model_range(frames)
        e = self.entries[i]
        if companion and tuple(x.shape[2:]) != (e.info.height, e.info.width):
            x = resize_crop(x, e.info.height, e.info.width, resize=True)
        return resize_crop(x, *self.size(i), resize=bool(self.buckets))

    def _companion_frames(self, e: ClipEntry, kind: str, indices: list[int]) -> torch.Tensor:
        """uint8 [F, h, w, 3] frames `indices` of clip e's `kind` file; VideoReadError (the clip is
        skipped and counted) when it is missing or has another length or aspect than the clip."""
        if e.companions.problem:
            raise VideoReadError(f"{e.path}: manifest row: {e.companions.problem}")
        path = getattr(e.companions, kind)
        if not path:
            raise VideoReadError(missing(kind, e.path))
        if not Path(path).is_file():
            raise VideoReadError(f"{kind} file {path} of {e.path} does not exist")
        info = probe(path)
        if info.frames != e.info.frames:
            raise VideoReadError(f"{kind} file {path} has {info.frames} frame(s), its clip {e.path} {e.info.frames}: "
                                 f"they must be the same length")
        h, w = e.info.height, e.info.width
        if abs(info.height * w - info.width * h) > max(h, w):
            raise VideoReadError(f"{kind} file {path} is {info.height}x{info.width}, its clip {e.path} {h}x{w}: "
                                 f"another aspect ratio cannot be aligned with the clip")
        return read_frames(path, indices, info)

    def _mask_frames(self, e: ClipEntry, indices: list[int]) -> torch.Tensor:
        """uint8 [F, h, w, C] of clip e's mask: its mask_boxes drawn at the clip's native size,
        else its mask file's frames."""
        if e.companions.boxes is not None and not e.companions.problem:
            try:
                return box_frames(e.companions.boxes, indices, e.info.frames, e.info.height, e.info.width)
            except ValueError as err:
                raise VideoReadError(f"{e.path}: {err}") from None
        return self._companion_frames(e, "mask", indices)
