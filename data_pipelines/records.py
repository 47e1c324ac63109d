"""Helpers for records people write by hand: corpus lines, manifest rows, caption files.

The rule everywhere: no silent garbage, and one bad record never stops a run. Bytes are
decoded as UTF-8 strictly (`errors="replace"` would turn a binary file or a Latin-1 corpus into
training data full of U+FFFD without a word); a record that cannot be read exactly is left out,
named by file and line, and counted; a file that is not text at all is refused by the caller
with one error naming it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path, PurePosixPath
from typing import Any, Callable, NamedTuple, TypeVar

T = TypeVar("T")

BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark some editors (Notepad, Excel) put first


def member_name(name: Any, where: str) -> str:
    """The name of a file that a data file (a cache manifest, a shard index) says lives in its own
    folder, checked to stay there: relative, no `..`, no URL scheme or drive. A data file is input
    from whoever wrote it: `"../../etc/passwd"` or an absolute path into another cache is refused
    (ValueError naming `where`), never opened."""
    text = name if isinstance(name, str) else ""
    parts = PurePosixPath(text.replace("\\", "/")).parts
    if not text or text.startswith(("/", "~")) or ".." in parts or "://" in text or text[1:2] == ":":
        raise ValueError(f"{where} names {name!r}: a data file may only name files inside its own folder "
                         f"(a relative path without '..'); rebuild it with the tool that made it")
    return text


def in_heldout(name: str, fraction: float) -> bool:
    """Whether the record called `name` belongs to the held-out split: a hash of the name, so
    the split is the same on every machine and a record keeps its side when data is added."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")
    return h / 2**32 < fraction


class Skip(NamedTuple):
    """One record left out: the file as the user named it, the 1-based line it is on, and why."""

    file: str
    line: int
    why: str


def normalize_newlines(data: bytes) -> bytes:
    """A file's bytes as text mode reads them: no leading byte-order mark, \\r\\n and \\r read as
    \\n, so that line numbers match what an editor shows. Safe on UTF-8: the bytes \\r and \\n
    never occur inside a multi-byte character."""
    if data.startswith(BOM):
        data = data[len(BOM):]
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def decode_utf8(raw: bytes) -> tuple[str | None, int, str]:
    """(text, -1, "") when `raw` is UTF-8 text, else (None, offset of the first bad byte, why)."""
    if b"\x00" in raw:  # valid UTF-8, but no text file holds it: binary data or UTF-16 text
        return None, raw.index(b"\x00"), "NUL byte (binary data, or UTF-16 text)"
    try:
        return raw.decode("utf-8"), -1, ""
    except UnicodeDecodeError as err:
        return None, err.start, f"not UTF-8 (byte 0x{raw[err.start]:02x})"


def line_column(raw: bytes, offset: int) -> tuple[int, int]:
    """(lines before `offset`, 1-based column of `offset` on its line) within `raw`."""
    return raw.count(b"\n", 0, offset), offset - (raw.rfind(b"\n", 0, offset) + 1) + 1


def unencodable(text: str) -> str:
    """'' if `text` can be written as UTF-8, else why not: JSON may escape unpaired surrogates
    ("\\ud800"), which parse but crash the byte tokenizer later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"holds an unpaired surrogate (\\u{ord(text[err.start]):04x})"
    return ""


def json_kind(value: Any) -> str:
    """How a JSON value of the wrong type is named in a message: null, a number (5), a list..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def describe(skips: list[Skip], unit: str, first: int = 3) -> str:
    """'skipped 3 line(s) of corpus.jsonl: line 4: "text" is null; line 9: ...; line 12: ...'
    (the first few named, the rest counted; all skips of one file)."""
    if not skips:
        return ""
    named = "; ".join(f"line {s.line}: {s.why}" for s in skips[:first])
    more = f"; and {len(skips) - first} more" if len(skips) > first else ""
    return f"skipped {len(skips)} {unit}(s) of {skips[0].file}: {named}{more}"


def left_out_error(kept: int, left_out: list, max_fraction: float, where: str, first: int = 3) -> str:
    """The error when more than `max_fraction` of a dataset's samples were left out while it was
    built (`left_out`: its (file, why) pairs: files missing or unreadable, unusable manifest rows,
    clips too small for a patch), else "". The same share data.max_dropped_fraction allows for
    clips that fail to decode during training: 3 clips left of 1,000,003 is no training set."""
    total = kept + len(left_out)
    if not left_out or len(left_out) <= max_fraction * total:
        return ""
    named = "; ".join(f"{file}: {why}" for file, why, *_ in left_out[:first])
    more = f"; and {len(left_out) - first} more" if len(left_out) > first else ""
    return (f"{len(left_out)} of the {total} samples of {where} were left out when the dataset was built "
            f"({len(left_out) / total:.1%} > data.max_dropped_fraction={max_fraction:g}), e.g. {named}{more}; fix or "
            f"remove them, or raise data.max_dropped_fraction")


_warned: set[str] = set()


def warn_once(log: logging.Logger, message: str) -> None:
    """Log `message` as a warning once per process: datasets are rebuilt several times per run
    (the data check, the train and the held-out split) and each would repeat it."""
    if message and message not in _warned:
        _warned.add(message)
        log.warning(message)


_parsed: dict[tuple[str, str], tuple[tuple[int, int], Any]] = {}
_parsing = threading.Lock()


def parsed_once(path: str | os.PathLike, parse: Callable[[Path], T]) -> T:
    """`parse(path)`, kept per process while the file keeps its size and mtime: a launch builds
    its dataset several times (the data check, the training set, the held-out split), and a
    manifest of a million lines costs ~5 CPU-s to parse (1 CPU-s measured for 200k rows) at
    each build. The result is shared: callers copy what they change. A file that cannot be
    stat'ed is parsed (its error is parse's)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError:
        return parse(path)
    key, version = (str(path.resolve()), f"{parse.__module__}.{parse.__qualname__}"), (st.st_size, st.st_mtime_ns)
    with _parsing:
        hit = _parsed.get(key)
    if hit is not None and hit[0] == version:
        return hit[1]
    value = parse(path)
    with _parsing:
        _parsed[key] = (version, value)  # one version per file: a rewritten one replaces it
    return value

