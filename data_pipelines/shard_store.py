"""Where shards live, and reading byte ranges out of them.

A shard set is addressed by one URL: a local folder, or any fsspec URL (`s3://bucket/prefix`,
`gs://...`, `https://...`). fsspec opens it with the user's storage options (data.storage_options:
s3fs's `key`, `secret`, `profile`, `client_kwargs.endpoint_url`, ...); s3fs (the `shards` extra)
serves `s3://`, gcsfs `gs://`, aiohttp `https://`.

Reading (`ShardReader.read`) asks for one sample's bytes: a byte-range request into its tar, the
range taken from the index (shard_index.py), so no shard is ever downloaded to read one sample.
What goes wrong is told apart:

- the shard is not there (FileNotFoundError) or shorter than the index says: a `VideoReadError`,
  skipped and counted like an undecodable clip (data.max_dropped_fraction);
- anything else (connection refused or reset, timeouts, 5xx, throttling): retried
  data.read_retries times, waiting data.retry_backoff_s, then twice as long, ...; then one
  `DataUnreachable` naming the URL, the tries and the last error (the run stops: a network
  problem is not a property of the data, and skipping would silently train on less).

`ShardCache` keeps whole shards on local disk (data.shard_cache_gb), so later epochs read them
locally.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import fsspec

from dit_train.config.errors import DataUnreachable
from dit_train.data_pipelines.video_io import VideoReadError

log = logging.getLogger(__name__)

SHARDS_EXTRA = "pip install 'dit_train[shards]'"


def plain(options: Any) -> dict:
    """Storage options as plain dicts (an OmegaConf node or a dataclass field's mapping)."""
    if isinstance(options, Mapping):
        return {str(k): plain(v) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return [plain(v) for v in options]  # type: ignore[return-value]
    return options


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def open_url(url: str, storage_options: Any = None, key: str = "data.url") -> tuple[Any, str]:
    """(fsspec filesystem, root path without a trailing slash) of `url`. A protocol whose package
    is missing, or an unknown one, is a ValueError naming `key` and what to install."""
    if not url or not str(url).strip():
        raise ValueError(f"{key} is empty: give the folder or URL of the shards (s3://bucket/prefix, a local folder)")
    url = str(url) if is_remote(str(url)) else os.path.expanduser(str(url))
    try:
        fs, root = fsspec.core.url_to_fs(url, **plain(storage_options or {}))
    except ImportError as err:  # fsspec names the package: "Install s3fs to access S3"
        extra = f" ({SHARDS_EXTRA} brings s3fs)" if url.startswith(("s3://", "s3a://")) else ""
        raise ValueError(f"{key}={url}: {err}{extra}") from err
    except (ValueError, TypeError) as err:  # unknown protocol, or an option the filesystem does not take
        raise ValueError(f"{key}={url}: {err} (check the URL and data.storage_options)") from err
    return fs, root.rstrip("/")


def join(root: str, name: str) -> str:
    return f"{root}/{name}" if root else name


def is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def put_bytes(fs: Any, path: str, data: bytes) -> None:
    """Write `data` to `path` whole: locally through a temporary file and a rename (a reader never
    sees half a file), remotely in one PUT (object stores replace objects atomically)."""
    if is_local(fs):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        fs.pipe_file(path, data)


def put_file(fs: Any, local: str, path: str) -> None:
    """Move the finished local file `local` to `path` (rename locally, upload elsewhere)."""
    if is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(local, path)
    else:
        fs.put_file(local, path)
        os.unlink(local)


class Retry:
    """Calls retried with exponential backoff: `tries` = 1 + retries; waits backoff_s, 2·backoff_s, ..."""

    def __init__(self, retries: int, backoff_s: float):
        self.retries, self.backoff_s = max(0, int(retries)), max(0.0, float(backoff_s))

    def __call__(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn() with retries. FileNotFoundError, a range past the end (EINVAL: the object is
        shorter than asked) and content errors (ValueError: bytes that were read but do not parse,
        such as a corrupt index.json) pass through at once; any other error is retried, then
        becomes DataUnreachable naming `what`."""
        waited = 0.0
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (FileNotFoundError, ValueError):
                raise
            except OSError as err:
                if err.errno == errno.EINVAL:  # "the requested range is not satisfiable"
                    raise
                last: BaseException = err
            except Exception as err:  # noqa: BLE001 - botocore / aiohttp / asyncio errors have no common base
                last = err
            if attempt < self.retries:
                pause = self.backoff_s * 2 ** attempt
                log.warning("reading %s failed (%s: %s); try %d of %d in %.1f s", what, type(last).__name__, last,
                            attempt + 2, self.retries + 1, pause)
                time.sleep(pause)
                waited += pause
        raise DataUnreachable(f"{what} could not be read after {self.retries + 1} tries over {waited:.1f} s "
                              f"({type(last).__name__}: {last}); check the endpoint, the network and the "
                              f"credentials (data.storage_options), or raise data.read_retries / "
                              f"data.retry_backoff_s") from last


class ShardCache:
    """Whole shards on local disk, `<cache_dir>/shards/<hash of the shard set's URL>/<shard>`,
    at most `limit_bytes` over every shard set under `<cache_dir>/shards/`.

    A shard is copied when a sample of it is first read and the copy fits: to make room, the
    least recently read shards of *other* shard sets are deleted; this set's own shards are never
    evicted for each other. The step plan visits every sample of an epoch in a seeded random
    order, so a cache smaller than the set would only trade one shard for another and download
    each many times; a shard that does not fit is read by byte ranges, as without a cache.
    Copies are written to a temporary name and renamed (local ranks may copy the same shard
    at once: both finish, one wins); a copy whose size differs from the index is not used.
    """

    def __init__(self, cache_dir: str, url: str, limit_bytes: int):
        self.base = Path(cache_dir).expanduser() / "shards"
        self.dir = self.base / hashlib.sha1(url.encode()).hexdigest()[:16]
        self.limit = int(limit_bytes)
        self._lock = threading.Lock()
        self._copying: set[str] = set()
        self._full = False

    def path(self, shard: str) -> Path:
        return self.dir / shard

    def local(self, shard: str, size: int) -> Path | None:
        """The local copy of `shard` (its size checked, its use time refreshed), or None."""
        p = self.path(shard)
        try:
            if p.stat().st_size == size:
                os.utime(p)  # least recently read goes first when another set needs room
                return p
        except OSError:
            pass
        return None

    def discard(self, shard: str) -> None:
        try:
            self.path(shard).unlink()
        except OSError:
            pass

    def used(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[Path, int, float]]:
        """(path, size, mtime) of every file under the cache, each stat'ed once. Other processes
        (local ranks, other runs) rename their `.part` copies into place or evict files while
        this one lists them: a file gone between the listing and its stat is not counted."""
        found = []
        for f in self.base.rglob("*") if self.base.is_dir() else ():
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((f, st.st_size, st.st_mtime))
        return found

    def want(self, shard: str, size: int) -> bool:
        """Whether this caller should copy `shard` now (room made if possible); False when it does
        not fit, is being copied by this process, or the cache is off."""
        if self.limit <= 0 or size > self.limit or self._full:
            return False
        with self._lock:
            if shard in self._copying:
                return False
            if not self._make_room(size):
                self._full = True  # this set filled its share: the rest is read by ranges
                return False
            self._copying.add(shard)
            return True

    def _make_room(self, size: int) -> bool:
        files = self._files()
        used = sum(n for _, n, _ in files)
        others = sorted((x for x in files if x[0].parent != self.dir), key=lambda x: x[2])
        while used + size > self.limit and others:
            victim, n, _ = others.pop(0)
            used -= n
            victim.unlink(missing_ok=True)
        return used + size <= self.limit

    def store(self, shard: str, fetch: Callable[[str], None]) -> None:
        """Copy `shard` with fetch(temporary local path), then rename it into place."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=shard + ".", suffix=".part", dir=self.dir)
        os.close(fd)
        try:
            fetch(tmp)
            os.replace(tmp, self.path(shard))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
            with self._lock:
                self._copying.discard(shard)


class ShardReader:
    """Byte ranges of the shards under one URL (see the module's docstring for what is retried
    and what is skipped). `stats` counts what was read remotely and locally (the benchmark and
    the tests read it). Thread-safe: the prefetch threads (data.num_workers) share one reader."""

    def __init__(self, url: str, storage_options: Any = None, retries: int = 5, backoff_s: float = 0.5,
                 cache: ShardCache | None = None):
        self.url, self.options = url, plain(storage_options or {})
        self.retry = Retry(retries, backoff_s)
        self.cache = cache
        self._fs: Any = None
        self.stats = {"remote_reads": 0, "local_reads": 0, "bytes": 0, "shards_copied": 0}
        self._missing: set[str] = set()

    @property
    def fs(self) -> Any:
        if self._fs is None:  # per process, on first use (a reader may be pickled into a worker)
            self._fs, self.root = open_url(self.url, self.options)
        return self._fs

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None}

    def where(self, shard: str) -> str:
        return f"{self.url.rstrip('/')}/{shard}"

    def read(self, shard: str, start: int, size: int, shard_size: int) -> bytes:
        """`size` bytes of `shard` from `start` (the shard is `shard_size` bytes long in the
        index). VideoReadError when the shard is missing or shorter; DataUnreachable after the
        retries (see Retry)."""
        fs = self.fs
        if shard in self._missing:
            raise VideoReadError(f"shard {self.where(shard)} is missing")
        local = self._local(shard, shard_size)
        if local is not None:
            try:
                with open(local, "rb") as f:
                    f.seek(start)
                    data = f.read(size)
            except FileNotFoundError as err:
                self._missing.add(shard)
                raise VideoReadError(f"shard {self.where(shard)} is missing ({err})") from err
            self.stats["local_reads"] += 1
        else:
            path = join(self.root, shard)
            try:
                data = self.retry(self.where(shard), lambda: fs.cat_file(path, start=start, end=start + size))
            except FileNotFoundError as err:
                self._missing.add(shard)
                raise VideoReadError(f"shard {self.where(shard)} is missing ({err})") from err
            except OSError as err:  # EINVAL: the range lies past the end of the object
                raise VideoReadError(f"shard {self.where(shard)} is shorter than its index says ({err})") from err
            self.stats["remote_reads"] += 1
        if len(data) != size:
            raise VideoReadError(f"shard {self.where(shard)} is shorter than its index says (bytes {start}.."
                                 f"{start + size} asked, {len(data)} read)")
        self.stats["bytes"] += size
        return data

    def forget_local(self, shard: str) -> None:
        """Drop a local copy found corrupt (the next read goes to the URL)."""
        if self.cache is not None:
            self.cache.discard(shard)

    def _local(self, shard: str, shard_size: int) -> Path | None:
        """The shard's local file: the shard itself for a local URL, else its cached copy (made
        now when the cache wants it); None = read a range remotely."""
        if is_local(self.fs):
            return Path(join(self.root, shard))
        if self.cache is None:
            return None
        found = self.cache.local(shard, shard_size)
        if found is not None or not self.cache.want(shard, shard_size):
            return found
        path = join(self.root, shard)
        try:
            self.cache.store(shard, lambda tmp: self.retry(self.where(shard), lambda: self.fs.get_file(path, tmp)))
        except FileNotFoundError:
            return None  # read() names the missing shard
        self.stats["shards_copied"] += 1
        return self.cache.local(shard, shard_size)
