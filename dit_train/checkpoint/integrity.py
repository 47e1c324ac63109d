"""Is a checkpoint folder intact? Its integrity record, and its DCP index when it has none.

A save writes `integrity.json` last: {file: [size, CRC-32]} of every other file of the folder.
`verify_checkpoint` checks it, then reads the DCP index (`.metadata`) through the restricted
unpickler of safe_load.py: a damaged index makes the checkpoint damaged (callers fall back to
an earlier one), an index holding anything a checkpoint never holds raises UnsafeCheckpoint
(refused outright, whatever its integrity record says: the record is a checksum, not a
signature). A folder without a record (written before records existed, or copied without it)
is checked by its index instead: every file the index lists is there and holds at least the
bytes the index says; a warning says that checksums were not checked.
"""
from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

from safetensors import safe_open

from dit_train.checkpoint.safe_load import METADATA, read_metadata, stored_files
from dit_train.config.errors import CheckpointError, UnsafeCheckpoint

log = logging.getLogger(__name__)

INTEGRITY = "integrity.json"


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def integrity_record(folder: Path) -> dict[str, list[int]]:
    """{file: [size, CRC-32]} of every file in a checkpoint folder but the record itself."""
    return {p.name: [p.stat().st_size, _crc(p)] for p in sorted(folder.iterdir()) if p.is_file() and p.name != INTEGRITY}


def _against_record(path: Path) -> str:
    try:
        want = json.loads((path / INTEGRITY).read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"unreadable {INTEGRITY}: {err}"
    if not isinstance(want, dict) or not all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
                                             for v in want.values()):
        return f"{INTEGRITY} is not a record of file sizes and checksums"
    for name, (size, crc) in want.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
        if _crc(f) != crc:
            return f"{name} does not match its checksum (damaged)"
    return ""


def _against_index(path: Path, need: dict[str, int]) -> str:
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing (its {METADATA} lists it)"
        if f.stat().st_size < size:
            return f"{name} has {f.stat().st_size} bytes, its {METADATA} needs {size} (truncated)"
    return ""


def _info_problem(path: Path) -> str:
    """What is wrong with trainer.json's values ('' = nothing): its step and world size are what a
    resume trusts first, and a damaged value there ("step": "abc") was a traceback mid-resume."""
    try:
        meta = json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError) as err:
        return f"unreadable trainer.json: {err}"
    if not isinstance(meta, dict):
        return "trainer.json is not a JSON object"
    step, world = meta.get("step"), meta.get("world_size")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"trainer.json has step={step!r} (a step is an integer >= 0)"
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        return f"trainer.json has world_size={world!r} (an integer >= 1)"
    if "format" in meta and not isinstance(meta.get("parts"), dict):
        return "trainer.json has no table of parts"
    return ""


def _rng_problem(path: Path) -> str:
    """What is wrong with the ranks' RNG files ('' = nothing): they are not in the DCP index, so a
    checkpoint without its integrity record is not checked for them otherwise."""
    for f in sorted(path.glob("rng_rank*.safetensors")):
        try:
            with safe_open(str(f), "pt") as state:
                for key in state.keys():
                    dtype = state.get_slice(key).get_dtype()
                    if dtype != "U8":
                        return f"{f.name} holds {key} as {dtype}, not a generator state (uint8)"
        except Exception as err:  # a truncated or overwritten file: safetensors' own error types
            return f"{f.name} is damaged ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    return ""


def verify_checkpoint(path: Path) -> str:
    """'' if the checkpoint folder is intact, else what is wrong (see the module docstring).
    Raises UnsafeCheckpoint if its `.metadata` holds objects no checkpoint holds."""
    path = Path(path)
    has_record = (path / INTEGRITY).is_file()
    if has_record and (why := _against_record(path)):
        return why
    for name in ("trainer.json", "config.yaml", METADATA):  # what every save writes besides the shards
        if not (path / name).is_file():
            return f"{name} is missing"
    try:
        md = read_metadata(path)
    except UnsafeCheckpoint:
        raise
    except CheckpointError as err:
        return str(err)
    if why := _info_problem(path) or _rng_problem(path):
        return why
    if has_record:
        return ""
    why = _against_index(path, stored_files(md))
    if not why:
        log.warning("checkpoint %s has no %s: checked that the files its %s lists are there and long enough, but "
                    "not their checksums", path, INTEGRITY, METADATA)
    return why
