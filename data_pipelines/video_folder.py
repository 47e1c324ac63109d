"""Your videos: a folder (recursive) of video files with same-stem .txt captions, or a
.csv/.jsonl manifest with columns `path` and `caption`.

Every file is probed once (frame count, size, fps; decord opens it and decodes one frame) so
token counts are known without decoding. Probe results are kept in an index file under
`data.cache_dir`, keyed by (path, size, mtime): later runs, and every rank of a run, read the
index instead of probing again; a changed or added file is probed anew. Files that cannot be
opened are skipped and counted (`ClipIndex.skipped`, and listed in the index file).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from data_pipelines.video_dataset import ClipEntry, read_manifest
from data_pipelines.video_io import VideoInfo, VideoReadError, probe

log = logging.getLogger(__name__)

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")


@dataclass
class ClipIndex:
    entries: list[ClipEntry]  # readable clips, sorted by path (sample ids are positions here)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of unreadable files
    uncaptioned: int = 0  # clips without a caption (kept, trained with the empty caption)


def list_clips(root: str | os.PathLike) -> list[tuple[str, str]]:
    """(absolute path, caption) of every clip under `root`, sorted by path.

    root: a folder, searched recursively for VIDEO_EXTENSIONS, each video's caption read from
    the .txt file with the same stem beside it (empty if none); or a .csv/.jsonl manifest with
    columns `path` (relative to the manifest's folder, or absolute) and `caption`.
    """
    root = Path(root).expanduser()
    if root.is_file():
        rows = read_manifest(root)
        if rows and "path" not in rows[0]:
            raise ValueError(f"manifest {root} needs a `path` column (and `caption`); it has {sorted(rows[0])}")
        base = root.parent
        out = [(str(Path(r["path"]) if Path(r["path"]).is_absolute() else (base / r["path"]).resolve()),
                str(r.get("caption") or "")) for r in rows]
    elif root.is_dir():
        out = []
        for p in sorted(root.rglob("*")):
            if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file():
                txt = p.with_suffix(".txt")
                out.append((str(p.resolve()), txt.read_text(encoding="utf-8").strip() if txt.is_file() else ""))
    else:
        raise ValueError(f"data.root={str(root)!r} does not exist; point it at a folder of videos or a .csv/.jsonl manifest")
    if not out:
        raise ValueError(f"data.root={str(root)!r} holds no video ({', '.join(VIDEO_EXTENSIONS)})")
    return sorted(out)


def index_path(cache_dir: str | os.PathLike, root: str | os.PathLike) -> Path:
    key = hashlib.sha1(str(Path(root).expanduser().resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "video_index" / f"{key}.jsonl"


def _stat_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _probe_row(path: str) -> dict:
    key = _stat_key(path)
    row = {"path": path, "size": key[0] if key else -1, "mtime_ns": key[1] if key else -1}
    if key is None:
        return {**row, "error": "file not found"}
    try:
        info = probe(path)
    except VideoReadError as err:
        return {**row, "error": str(err)}
    return {**row, "frames": info.frames, "height": info.height, "width": info.width, "fps": info.fps}


def index_clips(clips: list[tuple[str, str]], index_file: Path | None = None, workers: int = 0,
                progress: bool = True) -> ClipIndex:
    """Probe `clips` (reusing `index_file` where size and mtime still match) -> ClipIndex.

    workers: probe threads (decord releases the GIL while it decodes); 0 = in this thread.
    """
    cached: dict[str, dict] = {}
    if index_file is not None and index_file.exists():
        for line in index_file.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            cached[row["path"]] = row
    rows: dict[str, dict] = {}
    todo = []
    for path, _ in clips:
        old = cached.get(path)
        key = _stat_key(path)
        if old is not None and key is not None and (old["size"], old["mtime_ns"]) == key:
            rows[path] = old
        else:
            todo.append(path)
    if todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="probing videos", unit="file", disable=not progress or len(todo) < 20)
        if workers > 0:
            with ThreadPoolExecutor(workers, thread_name_prefix="probe") as pool:
                for row in pool.map(_probe_row, todo):
                    rows[row["path"]] = row
                    bar.update()
        else:
            for path in todo:
                rows[path] = _probe_row(path)
                bar.update()
        bar.close()
        if index_file is not None:
            _write_atomic(index_file, "".join(json.dumps(rows[p]) + "\n" for p, _ in clips))
    entries, skipped, uncaptioned = [], [], 0
    for path, caption in clips:
        row = rows[path]
        if "error" in row:
            skipped.append((path, row["error"]))
            continue
        entries.append(ClipEntry(path, caption, VideoInfo(row["frames"], row["height"], row["width"], row["fps"])))
        uncaptioned += not caption
    report = (str(index_file), len(skipped), uncaptioned)
    if report not in _reported:  # once per process, not once per dataset build
        _reported.add(report)
        if skipped:
            log.warning("skipped %d unreadable video(s) of %d, e.g. %s: %s (all listed in %s)",
                        len(skipped), len(clips), *skipped[0], index_file)
        if uncaptioned:
            log.warning("%d video(s) have no caption (no .txt beside them / empty caption column)", uncaptioned)
    return ClipIndex(entries, skipped, uncaptioned)


_reported: set[tuple[str, int, int]] = set()


def index_video_folder(root: str | os.PathLike, cache_dir: str | os.PathLike, workers: int = 0,
                       progress: bool = True) -> ClipIndex:
    """list_clips + index_clips with the index kept under `cache_dir` (idempotent, safe to race)."""
    return index_clips(list_clips(root), index_path(cache_dir, root), workers, progress)


def _write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
