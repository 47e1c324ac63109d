"""Files that appear whole or not at all.

A file is written under a temporary name in its destination's folder, then renamed over the
destination (`os.replace`: atomic within one filesystem). A write that fails or is interrupted
(full disk, unwritable folder, Ctrl-C) removes its temporary file and leaves the destination as
it was: no half file, no stray `*.tmp`. The temporary name is unique (pid + random), so two
writers of one folder never share it; it is created by the writer itself, so the file gets the
usual permissions (umask), not those of `tempfile.mkstemp` (0600).
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

from safetensors.torch import save_file


def temporary_name(path: Path) -> Path:
    """A hidden, unique name beside `path` (".weights.safetensors.<pid>.<random>.tmp")."""
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def write_atomic(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` fills a temporary file beside `path`, which then replaces `path`.
    Whatever `write` or the rename raises propagates after the temporary file is removed."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_file_atomic(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """safetensors' `save_file`, atomically (see the module doc)."""
    return write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def copy_atomic(src: str | Path, path: str | Path) -> Path:
    """A copy of `src` at `path`, atomically (see the module doc)."""
    return write_atomic(path, lambda tmp: shutil.copyfile(src, tmp))
