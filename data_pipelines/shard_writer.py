"""Writing shard sets (layout: shard_index.py): one tar per S consecutive samples of a source,
written with webdataset's TarWriter, then its index piece.

Shard k always holds the source's samples k·S .. (k+1)·S - 1 (those that can be read), so the
shards of a set can be written in any order, by any number of threads or processes, and a
shard whose piece exists is finished: a rerun skips it (`write_shards`). Each tar is written to
a local temporary file, scanned for its members' byte offsets (tarfile), then moved or uploaded
to the set's URL; its piece goes last.
"""
from __future__ import annotations

import json
import os
import tarfile
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tqdm import tqdm

from dit_train.data_pipelines.shard_index import piece_name, read_json, shard_name
from dit_train.data_pipelines.shard_store import SHARDS_EXTRA, join, put_bytes, put_file


@dataclass
class ShardSample:
    """One sample to write: its key (unique in the set), its members {ext: bytes or str} and
    the info its length follows from (shard_index.py)."""

    key: str
    members: dict
    info: dict


Skipped = tuple  # (source, why): a sample the shard should hold but whose data could not be read


def sample_key(position: int) -> str:
    """The key of the source's sample at `position`: unique, and tar order is sample order."""
    return f"{position:09d}"


def _tar_writer(fileobj: Any) -> Any:
    try:
        import webdataset  # deferred: ~1.2 s to import, and only writing shards needs it (the shards extra)
    except ImportError as err:
        raise ValueError(f"writing shards needs webdataset: {SHARDS_EXTRA}") from err
    # mtime fixed: the same samples give the same bytes (and checksums) on every run
    return webdataset.TarWriter(fileobj, mtime=0)


def write_shard(fs: Any, root: str, number: int, samples: Iterable[ShardSample | Skipped]) -> dict:
    """Write shard `number` of the set at (fs, root) from `samples`, then its piece; returns the piece."""
    fd, tmp = tempfile.mkstemp(prefix=f"{shard_name(number)}.", suffix=".tmp")
    kept: list[ShardSample] = []
    skipped: list[list[str]] = []
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _tar_writer(f)
            for s in samples:
                if isinstance(s, ShardSample):
                    writer.write({"__key__": s.key, **s.members})
                    kept.append(s)
                else:
                    skipped.append([str(s[0]), str(s[1])])
            writer.close()
        piece = _piece(tmp, number, kept, skipped)
        put_file(fs, tmp, join(root, shard_name(number)))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    put_bytes(fs, join(root, piece_name(number)), json.dumps(piece).encode())
    return piece


def _piece(tar_path: str, number: int, kept: list[ShardSample], skipped: list) -> dict:
    """The index piece of a written tar: each sample's byte range (first header to the end of
    its last member's data), its checksum and its members' places within the range."""
    spans: dict[str, list] = {}
    with tarfile.open(tar_path, "r:") as tar:
        for m in tar.getmembers():
            key, _, ext = m.name.partition(".")
            spans.setdefault(key, []).append((ext, m.offset, m.offset_data, m.size))
    offsets, sizes, crcs, members = [], [], [], []
    with open(tar_path, "rb") as f:
        for s in kept:
            parts = spans[s.key]
            start = parts[0][1]
            end = max(data + size for _, _, data, size in parts)
            f.seek(start)
            crcs.append(zlib.crc32(f.read(end - start)))
            offsets.append(start)
            sizes.append(end - start)
            members.append({ext: [data - start, size] for ext, _, data, size in parts})
    return {"url": shard_name(number), "nsamples": len(kept), "size": os.path.getsize(tar_path), "number": number,
            "keys": [s.key for s in kept], "offsets": offsets, "sizes": sizes, "crc32": crcs, "members": members,
            "info": [s.info for s in kept], "skipped": skipped}


def shard_count(total: int, per_shard: int) -> int:
    return -(-total // per_shard)


def write_shards(fs: Any, root: str, total: int, per_shard: int, produce: Callable[[int], Iterable],
                 shards: list[int] | None = None, workers: int = 1, progress: bool = True,
                 desc: str = "writing shards") -> dict:
    """Write the shards `shards` (default: all) of a set of `total` samples, `per_shard` each;
    produce(k) yields shard k's ShardSamples (or Skipped). Finished shards are skipped; `workers`
    threads write shards side by side. Returns {written, reused} (shards), {samples_written,
    samples_reused} and `skipped` ([source, why] of the samples written shards could not hold)."""
    todo = list(range(shard_count(total, per_shard))) if shards is None else list(shards)
    report = {"written": 0, "reused": 0, "samples_written": 0, "samples_reused": 0, "skipped": []}
    bar = tqdm(total=len(todo), desc=desc, unit="shard", disable=not progress)

    def one(k: int) -> tuple[bool, dict]:
        done = read_json(fs, join(root, piece_name(k)))
        return (True, done) if done is not None else (False, write_shard(fs, root, k, produce(k)))

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="shard") as pool:
        for reused, piece in pool.map(one, todo):
            report["reused" if reused else "written"] += 1
            report["samples_reused" if reused else "samples_written"] += piece["nsamples"]
            report["skipped"] += [] if reused else piece["skipped"]
            bar.update()
    bar.close()
    return report


# -- what a sample of each kind holds ---------------------------------------------------------


def pixel_sample(position: int, entry: Any) -> ShardSample | Skipped:
    """A clip or still (a ClipEntry: path, caption, probed info, companions) as its file's bytes,
    its caption and its info, with its mask / control files as members `mask.<ext>` /
    `control.<ext>` (their member names in the info; mask_boxes and a manifest row's companion
    problem in the info too); Skipped when a file cannot be read any more."""
    path = Path(entry.path)
    i = entry.info
    info = {"source": entry.path, "caption": entry.caption, "frames": i.frames, "height": i.height, "width": i.width,
            "fps": i.fps}
    try:
        members = {path.suffix.lower().lstrip(".") or "bin": path.read_bytes()}
        info |= companion_members(entry.companions, members)
    except OSError as err:
        return (entry.path, f"cannot read {err.filename or entry.path}: {err.strerror or err}")
    return ShardSample(sample_key(position), {**members, "txt": entry.caption, "json": json.dumps(info).encode()}, info)


def companion_members(c: Any, members: dict) -> dict:
    """Add a clip's companion files (companions.Companions) to `members`; returns what the
    index info says of them (shard_datasets.pixel_entries reads it back). OSError when a file
    cannot be read."""
    info: dict = {}
    for kind in ("mask", "control"):
        file = getattr(c, kind, "")
        if file and Path(file).is_file():  # a missing one stays missing: the reader skips its clip naming it
            name = f"{kind}{Path(file).suffix.lower()}"
            members[name] = Path(file).read_bytes()
            info[kind] = name
    if getattr(c, "boxes", None) is not None:
        info["mask_boxes"] = [c.boxes[0], c.boxes[1]]
    if getattr(c, "problem", ""):
        info["companion_problem"] = c.problem
    return info


def latent_sample(position: int, data: bytes, row: dict) -> ShardSample:
    """A latent sample: `data` = a latent cache's sample file (safetensors: latents, text_emb),
    `row` its manifest row (source, caption, latent_shape, text_len[, audio_len])."""
    info = {"source": row["source"], "caption": row["caption"], "latent_shape": list(row["latent_shape"]),
            "text_len": int(row.get("text_len", 0))}
    if row.get("audio_len"):  # cached audio latents (--audio-vae): their tokens, for the step plan
        info["audio_len"] = int(row["audio_len"])
    return ShardSample(sample_key(position), {"safetensors": data, "json": json.dumps(info).encode()}, info)


def slice_of(k: int, per_shard: int, total: int) -> range:
    """The source positions shard k holds."""
    return range(k * per_shard, min(total, (k + 1) * per_shard))


def pixel_shard(entries: list, per_shard: int) -> Callable[[int], Iterator]:
    """produce(k) for write_shards over ClipEntries."""
    return lambda k: (pixel_sample(p, entries[p]) for p in slice_of(k, per_shard, len(entries)))
