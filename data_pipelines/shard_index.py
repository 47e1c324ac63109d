"""The index of a shard set: every sample's place in its tar and what its length follows from.

Layout under the set's URL (webdataset format: a sample is the tar members `<key>.<ext>` that
share a key; pixels: `<key>.mp4` (or the still's `.jpg`/`.png`, the source file's bytes as they
were), `<key>.txt` (caption), `<key>.json`; latents: `<key>.safetensors` holding `latents` and
`text_emb` exactly as a latent cache's sample file, and `<key>.json`):

    shard-000000.tar ...        the shards; shard k holds the source's samples k·S .. (k+1)·S - 1
    shard-000000.json ...       shard k's index piece, written after its tar: "shard k is finished"
    meta.json                   kind (pixels | latents), the settings the set was made with and
                                their fingerprint; latents: the latent cache's meta (VAE, text
                                encoder, channels, ...)
    null_text_emb.safetensors   latents with captions: the empty caption's embedding
    index.json                  the pieces merged, in order, once every shard is finished

A piece (and each entry of index.json's `shardlist`) is columnar: `url` (the tar's name),
`nsamples`, `size` (bytes), then per sample `keys`, `offsets` and `sizes` (the byte range of its
members, headers included), `crc32` (of that range), `members` ({ext: [offset in the range,
size]}) and `info`: what its token count follows from without reading it — pixels: source file,
caption, frames, height, width, fps (the data.* read settings and the patch then give the length,
as for a folder); latents: source, caption, latent_shape, text_len. `skipped`: [source, why] of
samples the shard should have held but could not read.

index.json is also a wids dataset description (`wids_version: 1`, `shardlist` of `url` and
`nsamples`), so webdataset's indexed reader can open the same set.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any

from dit_train.data_pipelines.records import member_name
from dit_train.data_pipelines.shard_store import Retry, join, open_url, plain, put_bytes

INDEX, META, NULL_TEXT = "index.json", "meta.json", "null_text_emb.safetensors"
FORMAT = "dit_train-shards"
KINDS = ("pixels", "latents")


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.tar"


def piece_name(k: int) -> str:
    return f"shard-{k:06d}.json"


def fingerprint(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def read_json(fs: Any, path: str) -> dict | None:
    """The JSON object at `path`, or None when there is none."""
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return None
    return json.loads(raw)


def check_or_write_meta(fs: Any, root: str, meta: dict, write: bool, where: str) -> None:
    """Refuse to add shards made with other settings to `where`; write meta.json when `write`."""
    old = read_json(fs, join(root, META))
    if old is not None and old.get("fingerprint") != meta["fingerprint"]:
        a, b = old.get("settings", {}), meta["settings"]
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise ValueError(f"{where} holds shards made with other settings (differ: {', '.join(diff)}); "
                         f"pick another output or delete it")
    if write:
        put_bytes(fs, join(root, META), json.dumps(meta, indent=2).encode())


def merge_index(fs: Any, root: str, count: int, meta: dict, where: str, skipped: list | tuple = ()) -> dict:
    """index.json from the pieces of shards 0..count-1 (every one must be finished); returns it.
    `skipped`: [source, why] of what the source itself left out (listed before the shards' own)."""
    pieces = []
    for k in range(count):
        piece = read_json(fs, join(root, piece_name(k)))
        if piece is None:
            raise ValueError(f"{where}: shard {k} ({shard_name(k)}) is not finished; run the same command again "
                             f"(finished shards are skipped)")
        pieces.append(piece)
    index = {"wids_version": 1, "__kind__": FORMAT, "format": 1, "kind": meta["kind"], "meta": meta,
             "samples": sum(p["nsamples"] for p in pieces),
             "skipped": [list(s) for s in skipped] + [s for p in pieces for s in p["skipped"]],
             "shardlist": pieces}
    put_bytes(fs, join(root, INDEX), json.dumps(index).encode())
    forget(where)
    return index


@dataclass(frozen=True)
class Location:
    """Where one sample's bytes are: `size` bytes of tar `shard` (of `shard_size` bytes) from
    `offset`; `crc32` of those bytes; `members` {ext: (offset within them, size)}."""

    shard: str
    shard_size: int
    offset: int
    size: int
    crc32: int
    members: dict


@dataclass
class ShardIndex:
    """A loaded index.json: the set's kind and meta, each sample's location and info, in order."""

    url: str
    kind: str
    meta: dict
    locations: list[Location]
    infos: list[dict]
    skipped: list

    @classmethod
    def from_json(cls, url: str, index: dict) -> "ShardIndex":
        """The loaded index; ValueError naming index.json and the shard when a value is missing or
        out of its range (a hand-edited or damaged index was a traceback when the plan read it)."""
        where = f"{url.rstrip('/')}/{INDEX}"
        locations, infos = [], []
        try:
            for piece in index["shardlist"]:
                member_name(piece["url"], where)  # a shard of this set, never a path out of it
                _counts(piece, ("nsamples", "size"), where)
                for j in range(piece["nsamples"]):
                    loc = Location(piece["url"], piece["size"], piece["offsets"][j], piece["sizes"][j],
                                   piece["crc32"][j], {e: tuple(v) for e, v in piece["members"][j].items()})
                    _counts(vars(loc), ("offset", "size", "crc32"), f"{where} ({piece['url']}, sample {j})")
                    info = piece["info"][j]
                    _counts(info, INFO_COUNTS[index["kind"]], f"{where} ({piece['url']}, sample {j})")
                    locations.append(loc)
                    infos.append(info)
            skipped = [tuple(s) for s in index["skipped"]]
        except (KeyError, IndexError, TypeError, AttributeError) as err:
            raise ValueError(f"{where} is damaged ({type(err).__name__}: {err}); remake the set with "
                             f"python -m dit_train.tools.make_shards (or tools.cache_latents --shards)") from None
        return cls(url, index["kind"], index.get("meta", {}), locations, infos, skipped)


# what each sample's info must hold as non-negative integers, by the set's kind (what its length and
# its read follow from); latents: latent_shape is a list of four
INFO_COUNTS = {"pixels": ("frames", "height", "width"), "latents": ()}


def _counts(record: Any, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        v = record[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where} has {key}={v!r} (an integer >= 0): the index is damaged; remake the set with "
                             f"python -m dit_train.tools.make_shards (or tools.cache_latents --shards)")


_loaded: dict[tuple[str, str], ShardIndex] = {}
_loading = threading.Lock()


def forget(url: str) -> None:
    """Drop this process's loaded copy of `url`'s index (it was just rewritten)."""
    with _loading:
        for key in [k for k in _loaded if k[0] == str(url)]:
            del _loaded[key]


def load_index(url: str, storage_options: Any = None, retries: int = 5, backoff_s: float = 0.5) -> ShardIndex:
    """The index of the shard set at `url`, read once per process while it is unchanged (source
    objects are made many times per run; a rewritten index.json has another ETag / mtime).
    ValueError naming data.url when there is none or it is not one; network errors are retried,
    then DataUnreachable."""
    fs, root = open_url(url, storage_options)
    retry, where = Retry(retries, backoff_s), f"{url.rstrip('/')}/{INDEX}"
    try:
        version = retry(where, lambda: fs.ukey(join(root, INDEX)))
    except FileNotFoundError:
        version = None
    key = (str(url), json.dumps(plain(storage_options or {}), sort_keys=True, default=str), version)
    with _loading:
        if key in _loaded:
            return _loaded[key]
    try:
        raw = retry(where, lambda: read_json(fs, join(root, INDEX))) if version is not None else None
    except ValueError as err:  # read, and not JSON (Retry passes content errors through at once)
        raise ValueError(f"{where} is not a readable index ({err}); remake the set with "
                         f"python -m dit_train.tools.make_shards") from None
    if raw is None:
        raise ValueError(f"data.url={url} holds no {INDEX}: write shards with python -m dit_train.tools.make_shards "
                         f"--out {url} (or tools.cache_latents --out {url}); an interrupted run writes it when "
                         f"run again")
    if raw.get("__kind__") != FORMAT or raw.get("kind") not in KINDS:
        raise ValueError(f"data.url={url}: {INDEX} is not a dit_train shard index (made by tools.make_shards)")
    index = ShardIndex.from_json(url, raw)
    if not index.locations:
        raise ValueError(f"data.url={url}: the index lists no sample ({len(index.skipped)} skipped when the shards were "
                         f"made)")
    with _loading:
        _loaded[key] = index
    return index
