"""Your videos and images: a folder (recursive) of video and still-image files with same-stem
.txt captions, or a .csv/.jsonl manifest with columns `path` and `caption`.

Every file is probed once (frame count, size, fps; decord opens a video and decodes one frame,
Pillow reads an image's header: 1 frame) so token counts are known without decoding. Probe
results, videos' and images' alike, are kept in an index file under `data.cache_dir`, keyed by
(path, size, mtime): later runs, and every rank of a run, read the index instead of probing
again; a changed or added file is probed anew. Files that cannot be opened are skipped and
counted (`ClipIndex.skipped`, and listed in the index file); so are clips whose caption file is
not UTF-8 and manifest rows that cannot be used, each named with its file (and line) in a
warning.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from dit_train.atomic import write_atomic
from dit_train.data_pipelines.companions import companion_files, folder_companions, row_companions, row_path
from dit_train.data_pipelines.records import decode_utf8, normalize_newlines, parsed_once, warn_once
from dit_train.data_pipelines.video_dataset import MANIFEST_SUFFIXES, ClipEntry, scan_manifest
from dit_train.data_pipelines.video_io import IMAGE_EXTENSIONS, VideoInfo, VideoReadError, probe

log = logging.getLogger(__name__)

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")
MEDIA_EXTENSIONS = VIDEO_EXTENSIONS + IMAGE_EXTENSIONS  # what a folder scan picks up (any case)


@dataclass
class ClipIndex:
    entries: list[ClipEntry]  # readable clips, sorted by path (sample ids are positions here)
    # (where, why) of clips left out: unreadable videos and caption files (where = the video),
    # unusable manifest rows (where = "<manifest>:<line>")
    skipped: list[tuple[str, str]] = field(default_factory=list)
    uncaptioned: int = 0  # clips without a caption (kept, trained with the empty caption)


def scan_clips(root: str | os.PathLike) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(absolute path, caption) of every clip under `root`, sorted by path, and (where, why) of
    each clip left out (warned about once).

    root: a folder, searched recursively for MEDIA_EXTENSIONS (videos and still images, any
    case: .MP4, .JPG too), each file's caption read from the file beside it with the same stem
    and extension .txt in any case (clip.txt, else clip.TXT; empty caption if there is none);
    or a .csv/.jsonl manifest with columns `path` (relative to the manifest's folder, or
    absolute) and `caption` (rows left out: see scan_manifest; `where` is `<manifest>:<line>`).

    A caption file that cannot be read as UTF-8 leaves its clip out (`where` is the video, `why`
    names the caption file) rather than training it uncaptioned: the author meant the clip to
    be conditioned on that text, and an unconditional example in its place would go unnoticed;
    the fix (save the caption as UTF-8) is the user's.
    """
    if root is None or not os.fspath(root).strip():  # Path("") is ".": it would scan the working directory
        raise ValueError("data=video_folder needs data.root=<folder of videos, or a .csv/.jsonl manifest>")
    root = Path(root).expanduser()
    if root.is_file():
        if root.suffix.lower() not in MANIFEST_SUFFIXES:
            raise ValueError(f"data.root={str(root)!r} is a file but not a .csv/.jsonl manifest; point it at the "
                             f"folder holding the videos, or at a manifest")
        rows, skipped = scan_manifest(root)
        base = root.parent
        out = [(row_path(base, r["path"]), r["caption"]) for r in rows]
    elif root.is_dir():
        out, skipped = _scan_folder(root)
    else:
        raise ValueError(f"data.root={str(root)!r} does not exist; point it at a folder of videos or a .csv/.jsonl manifest")
    if not out:
        raise ValueError(f"data.root={str(root)!r} holds no video or image ({', '.join(MEDIA_EXTENSIONS)})"
                         + (f"; {len(skipped)} left out, e.g. {skipped[0][0]}: {skipped[0][1]}" if skipped else ""))
    return sorted(out), skipped


def list_clips(root: str | os.PathLike) -> list[tuple[str, str]]:
    """(absolute path, caption) of every clip under `root`, sorted by path (see scan_clips)."""
    return scan_clips(root)[0]


def _scan_folder(root: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    files = sorted(root.rglob("*"))
    captions: dict[tuple[Path, str], list[Path]] = {}
    for p in files:
        if p.suffix.lower() == ".txt":
            captions.setdefault((p.parent, p.stem), []).append(p)
    out, skipped = [], []
    media = [p for p in files if p.suffix.lower() in MEDIA_EXTENSIONS and p.is_file()]
    beside = companion_files(media)  # clip.mask.mp4, clip.control.mp4: read with clip.mp4, never clips
    for p in media:
        if p in beside:
            continue
        # clip.txt first, then clip.TXT, then any other case (one caption per clip on case-sensitive disks)
        found = sorted(captions.get((p.parent, p.stem), []),
                       key=lambda q: (q.suffix != ".txt", q.suffix != ".TXT", q.name))
        caption, why = _read_caption(found[0]) if found else ("", "")
        if why:
            skipped.append((str(p.resolve()), why))
        else:
            out.append((str(p.resolve()), caption))
    if skipped:
        warn_once(log, f"skipped {len(skipped)} clip(s) whose caption file cannot be read, e.g. {skipped[0][1]} "
                       f"(all listed in ClipIndex.skipped)")
    return out, skipped


def _read_caption(txt: Path) -> tuple[str, str]:
    """(caption, "") of a caption file, or ("", why) naming the file."""
    try:
        raw = normalize_newlines(txt.read_bytes())
    except OSError as e:
        return "", f"caption file {txt} cannot be read: {e.strerror or e}"
    text, bad_at, why = decode_utf8(raw)
    if text is None:
        return "", f"caption file {txt}: {why} at offset {bad_at}; save it as UTF-8"
    return text.strip(), ""


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


def _probe_index(index_file: Path) -> dict[str, dict]:
    """The probe rows of an index file by path (lines that are not JSON are probed again)."""
    cached: dict[str, dict] = {}
    for line in index_file.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        cached[row["path"]] = row
    return cached


def index_clips(clips: list[tuple[str, str]], index_file: Path | None = None, workers: int = 0,
                progress: bool = True) -> ClipIndex:
    """Probe `clips` (reusing `index_file` where size and mtime still match) -> ClipIndex.

    workers: probe threads (decord releases the GIL while it decodes); 0 = in this thread.
    """
    # read once per process while unchanged (each dataset build of a launch asks); shared: only read here
    cached = parsed_once(index_file, _probe_index) if index_file is not None and index_file.exists() else {}
    rows: dict[str, dict] = {}
    todo = []
    for path, _ in clips:
        old = cached.get(path)
        key = _stat_key(path)
        # a file still missing keeps its cached row too: a manifest of a million missing files was
        # probed again, and its index rewritten, at every dataset build of every launch
        if old is not None and (old["size"], old["mtime_ns"]) == (key or (-1, -1)):
            rows[path] = old
        else:
            todo.append(path)
    if todo:
        bar = tqdm(total=len(todo), desc="probing videos/images", unit="file", disable=not progress or len(todo) < 20)
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
            text = "".join(json.dumps(rows[p]) + "\n" for p, _ in clips)
            index_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(index_file, lambda tmp: tmp.write_text(text))
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
            log.warning("skipped %d unreadable video(s)/image(s) of %d, e.g. %s: %s (all listed in %s)",
                        len(skipped), len(clips), *skipped[0], index_file)
        if uncaptioned:
            log.warning("%d video(s)/image(s) have no caption (no .txt beside them / empty caption column)", uncaptioned)
    return ClipIndex(entries, skipped, uncaptioned)


_reported: set[tuple[str, int, int]] = set()


def index_video_folder(root: str | os.PathLike, cache_dir: str | os.PathLike, workers: int = 0,
                       progress: bool = True) -> ClipIndex:
    """scan_clips + index_clips with the index kept under `cache_dir` (idempotent, safe to race).
    `skipped` lists the clips scan_clips left out first, then the unreadable videos."""
    clips, left_out = scan_clips(root)  # first: refuses an empty root before index_path resolves it
    index = index_clips(clips, index_path(cache_dir, root), workers, progress)
    index.skipped = left_out + index.skipped
    return index


def with_companions(entries: list[ClipEntry], root: str | os.PathLike) -> list[ClipEntry]:
    """`entries` with their mask / control files (data_pipelines/companions.py): found beside each
    clip for a folder, from the `mask`, `control` and `mask_boxes` columns for a manifest."""
    root = Path(root).expanduser()
    if root.is_file():
        rows = scan_manifest(root)[0]
        by_path = {row_path(root.parent, r["path"]): row_companions(r, root.parent) for r in rows}
    else:
        by_path = folder_companions([e.path for e in entries])
    return [dataclasses.replace(e, companions=by_path[e.path]) if e.path in by_path else e for e in entries]

