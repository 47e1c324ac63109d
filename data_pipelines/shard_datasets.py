"""Datasets over a shard set: the folder's and the latent cache's datasets, reading each sample
out of its tar by one byte-range request.

Sample ids, lengths and what a sample decodes to are those of the data the shards were made
from: pixel shards keep each source file's bytes and probed size (`VideoClipDataset` applies the
same data.* read settings and patch to them), latent shards the latent cache's rows and tensors
(`LatentCacheDataset`). So `data=shards` trains on the same samples, in the same order, to the
same weights as the folder or cache they were made from.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from safetensors.torch import load as load_safetensors

from dit_train.data_pipelines.companions import Companions
from dit_train.data_pipelines.latent_cache import LatentCacheDataset
from dit_train.data_pipelines.shard_index import NULL_TEXT, Location, ShardIndex
from dit_train.data_pipelines.shard_store import ShardReader
from dit_train.data_pipelines.video_dataset import ClipEntry, VideoClipDataset
from dit_train.data_pipelines.video_io import VideoInfo, VideoReadError, read_frames


def sample_bytes(reader: ShardReader, loc: Location) -> bytes:
    """A sample's bytes (all its members), checked against the index's checksum. A copy in the
    local shard cache that fails the check is dropped and the range read again from the URL;
    VideoReadError when the bytes are wrong there too (a corrupt shard: skipped and counted)."""
    data = reader.read(loc.shard, loc.offset, loc.size, loc.shard_size)
    if zlib.crc32(data) != loc.crc32 and reader.cache is not None and reader.cache.local(loc.shard, loc.shard_size):
        reader.forget_local(loc.shard)
        data = reader.read(loc.shard, loc.offset, loc.size, loc.shard_size)
    if zlib.crc32(data) != loc.crc32:
        raise VideoReadError(f"shard {reader.where(loc.shard)} is corrupt: bytes {loc.offset}..{loc.offset + loc.size} "
                             f"do not match their checksum in the index")
    return data


def member(data: bytes, loc: Location, ext: str) -> bytes:
    rel, size = loc.members[ext]
    return data[rel:rel + size]


@dataclass(frozen=True)
class ShardEntry(ClipEntry):
    """A clip of a pixel shard: `path` is the source file it was made from (its name decides the
    held-out split and its extension the reader, as for the folder), `loc` where its bytes are."""

    loc: Location = field(default=None)  # type: ignore[assignment]


def pixel_entries(index: ShardIndex) -> list[ShardEntry]:
    return [ShardEntry(i["source"], i["caption"], VideoInfo(int(i["frames"]), int(i["height"]), int(i["width"]),
                                                          float(i["fps"])), info_companions(i), loc=loc)
            for i, loc in zip(index.infos, index.locations)]


def info_companions(info: dict) -> Companions:
    """A pixel sample's companions from its index info (shard_writer.companion_members): mask /
    control are member names of the sample, not paths."""
    boxes = info.get("mask_boxes")
    return Companions(info.get("mask", ""), info.get("control", ""), tuple(boxes) if boxes is not None else None,
                      info.get("companion_problem", ""))


@contextmanager
def member_file(media: bytes, suffix: str) -> Iterator[str]:
    """A member's bytes as a temporary file named with `suffix` (readers pick the decoder by it)."""
    fd, tmp = tempfile.mkstemp(prefix="dit_train_shard_", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(media)
        yield tmp
    finally:
        os.unlink(tmp)


class ShardClipDataset(VideoClipDataset):
    """VideoClipDataset over pixel shards: frames are decoded from the member bytes (written to a
    temporary file named like the source, so every reader decodes exactly what it decodes from
    the folder); a clip's mask and control video from its `mask.<ext>` / `control.<ext>` members
    the same way."""

    def __init__(self, entries: list[ShardEntry], reader: ShardReader, **kw):
        self.reader = reader
        self._last: tuple[tuple[str, int], bytes] | None = None  # (shard, offset), the sample's bytes
        super().__init__(entries, **kw)

    def _sample_bytes(self, loc: Location, fresh: bool = False) -> bytes:
        """sample_bytes, read once for a clip and its mask / control members: they are members of
        the same sample, read right after the clip (on object storage each read is a range GET).
        fresh: read again (a clip's own read always is; its companions reuse those bytes)."""
        last = self._last
        if not fresh and last is not None and last[0] == (loc.shard, loc.offset):
            return last[1]
        data = sample_bytes(self.reader, loc)
        self._last = ((loc.shard, loc.offset), data)
        return data

    def read(self, e: ClipEntry, indices: list[int]) -> torch.Tensor:
        loc = e.loc  # type: ignore[attr-defined]
        ext = os.path.splitext(e.path)[1].lower()
        media = member(self._sample_bytes(loc, fresh=True), loc, ext.lstrip(".") or "bin")
        try:
            with member_file(media, ext) as tmp:
                frames = read_frames(tmp, indices, e.info)
        except VideoReadError as err:
            raise VideoReadError(f"{self.reader.where(loc.shard)} ({e.path}): {err}") from err
        # the plan sized this clip from the index; a clip that decodes to another size (a damaged or
        # hand-edited index: height and width swapped) would train on other tokens than planned
        if tuple(frames.shape[1:3]) != (e.info.height, e.info.width):
            raise VideoReadError(f"{self.reader.where(loc.shard)} ({e.path}): decodes to {frames.shape[2]}x"
                                 f"{frames.shape[1]} but index.json says {e.info.width}x{e.info.height}; the index "
                                 f"is damaged: remake the set with python -m dit_train.tools.make_shards")
        return frames

    def _companion_frames(self, e: ClipEntry, kind: str, indices: list[int]) -> torch.Tensor:
        name = getattr(e.companions, kind)
        if not name or e.companions.problem:  # the folder's reasons (missing, a bad manifest row)
            return super()._companion_frames(e, kind, indices)
        loc = e.loc  # type: ignore[attr-defined]
        media = member(self._sample_bytes(loc), loc, name)
        try:
            with member_file(media, os.path.splitext(name)[1]) as tmp:
                return super()._companion_frames(dataclasses.replace(e, companions=dataclasses.replace(
                    e.companions, **{kind: tmp})), kind, indices)
        except VideoReadError as err:
            raise VideoReadError(f"{self.reader.where(loc.shard)} ({e.path}, its {kind}): {err}") from err


class ShardLatentDataset(LatentCacheDataset):
    """LatentCacheDataset over latent shards: the rows come from the index, each sample's tensors
    from its `.safetensors` member, the empty caption's embedding from the set's root."""

    def __init__(self, index: ShardIndex, reader: ShardReader, patch: tuple[int, int, int], split: str = "",
                 heldout_fraction: float = 0.0):
        self.reader, self.root = reader, index.url
        rows = [{**info, "loc": loc} for info, loc in zip(index.infos, index.locations)]
        self.keep_rows(index.meta["latent"], rows, patch, split, heldout_fraction, f"the shards at {index.url}")

    def tensors(self, row: dict) -> dict[str, torch.Tensor]:
        loc = row["loc"]
        data = sample_bytes(self.reader, loc)
        try:
            return load_safetensors(member(data, loc, "safetensors"))
        except Exception as err:  # a checksum-valid but unreadable member: made by another tool
            raise VideoReadError(f"{self.reader.where(loc.shard)} ({row['source']}): cannot read its latents: {err}") from err

    def null_text_emb(self) -> torch.Tensor:
        if not self.meta.get("null_text_emb"):
            raise ValueError(f"the shards at {self.root} have no text embeddings (made without --text-encoder)")
        fs = self.reader.fs
        raw = self.reader.retry(f"{self.root.rstrip('/')}/{NULL_TEXT}", lambda: fs.cat_file(f"{self.reader.root}/{NULL_TEXT}"))
        return load_safetensors(raw)["text_emb"].float()
