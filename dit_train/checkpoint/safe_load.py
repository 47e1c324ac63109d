"""Reading torch.distributed.checkpoint (DCP) folders without running code from their files.

DCP keeps a checkpoint's index (`.metadata`) as a Python pickle and the non-tensor values of a
state dict (the optimizer's hyper-parameters: lr, betas, ...) as `torch.save` pickles, and torch
2.13 reads both with the full unpickler: a forged folder (a pickle payload in `.metadata`, its
`integrity.json` rewritten to match) would run code on load. Here instead:

- `.metadata` goes through `MetadataUnpickler`, which builds only what DCP writes there (read
  off torch 2.13's checkpoint/metadata.py and filesystem.py, and off real checkpoints of every
  kind this project writes: full, FSDP2-sharded, LoRA, EMA, SGD/AdamW state with step counts):
  the metadata dataclasses, `_StorageInfo`, `torch.Size`, torch dtypes and layouts and a
  `pathlib.PosixPath`. Any other global (a function to call, another class) is refused before
  it is looked up, so nothing in the file runs; the storage index may only name files inside
  the folder;
- values stored as bytes are read with `torch.load(weights_only=True)` (`SafePlanner`);
- tensors are read with `weights_only=True` by torch's own FileSystemReader already.

`load(state, folder)` is how this project reads a DCP folder; `read_metadata(folder)` is what
integrity checks use. A refused file raises `UnsafeCheckpoint`, naming it.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import functools

import torch

from dit_train.config.errors import CheckpointError, UnsafeCheckpoint
from dit_train.sharded import loaded_type

# torch.distributed.checkpoint (DCP) is imported by the functions that read or write a
# checkpoint: it imports torch.distributed.tensor (~1.8 s at every start of `python -m dit_train`
# and of the tools, `--help` and a refused config included)

METADATA = ".metadata"

_DCP = "torch.distributed.checkpoint"
# (module, name) of every global a DCP `.metadata` written by torch 2.13 refers to
_ALLOWED = {
    *((f"{_DCP}.metadata", name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                              "MetadataIndex", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id when the writer was given a Path
}


class _Refused(pickle.UnpicklingError):
    pass


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`: only the globals in _ALLOWED (and torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def refusal_reason(err: BaseException) -> str:
    """What torch's weights_only unpickler refused, without its advice: the first line of its
    message says to retry with weights_only=False, the one thing a refusal must never suggest."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:  # torch names the global it refused, then suggests allow-listing it: keep the name only
        return f"a reference to {found.group(1)}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "weights_only" not in ln and "trust" not in ln]
    return lines[0].removeprefix("WeightsUnpickler error: ") if lines else "objects other than tensors and plain data"


def unsafe_message(path: Path, what: str) -> str:
    return (f"{path} holds {what}, which no checkpoint holds (forged, or not written by dit_train); it was refused "
            f"without being loaded (loading it could run code): delete that checkpoint folder, and use checkpoints "
            f"from sources you trust")


def read_metadata(folder: str | Path) -> Metadata:
    """The DCP index of a checkpoint folder, through MetadataUnpickler. Raises UnsafeCheckpoint
    for a refused object, CheckpointError if the file is missing or is not a DCP index
    (damaged), naming the file."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as f:
            md = MetadataUnpickler(f).load()
    except _Refused as err:
        raise UnsafeCheckpoint(unsafe_message(path, f"a pickled reference to {err}")) from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err.strerror}") from None
    except Exception as err:  # noqa: BLE001 - any parse failure of a damaged file (EOFError, KeyError, ...)
        raise CheckpointError(f"{path} is not a readable checkpoint index (damaged: {type(err).__name__}: {err})") from None
    # deferred: DCP (~1.8 s), see the top of this module
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata  # (the same)

    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{path} is not a checkpoint index (it holds a {type(md).__name__})")
    for info in md.storage_data.values():
        if not isinstance(info, _StorageInfo) or Path(str(info.relative_path)).name != info.relative_path \
                or info.relative_path in ("", ".", ".."):
            raise UnsafeCheckpoint(unsafe_message(path, f"a storage entry outside its folder ({info!r})"))
    return md


def stored_files(md: Metadata) -> dict[str, int]:
    """{file name: bytes DCP's index says it holds at least} (offset + length of its last item)."""
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    return need


@functools.cache
def safe_io() -> tuple[type, type]:
    """(SafeReader, SafePlanner): DCP's reader and planner, made at the first load (they subclass
    DCP's classes, and DCP is imported only when a checkpoint is read)."""
    # deferred: DCP (~1.8 s), see the top of this module
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element  # (the same)
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta  # (the same)

    class SafeReader(FileSystemReader):
        """torch's FileSystemReader with the index read through MetadataUnpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            md = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))).parent)
            if md.storage_meta is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class SafePlanner(DefaultLoadPlanner):
        """torch's DefaultLoadPlanner with non-tensor values read by torch.load(weights_only=True)
        (plain data and tensors only) instead of the full unpickler."""

        def __init__(self, folder: Path):
            super().__init__()
            self.folder = folder

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                name = self.metadata.storage_data[read_item.storage_index].relative_path if self.metadata else "?"
                raise UnsafeCheckpoint(unsafe_message(self.folder / name, f"an object that is not plain data as the "
                                                      f"value of {fqn} ({refusal_reason(err)})")) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeReader, SafePlanner


def is_checkpoint_exception(err: BaseException) -> bool:
    """isinstance(err, DCP's CheckpointException), without importing DCP (none is raised before it is loaded)."""
    cls = loaded_type("torch.distributed.checkpoint.api", "CheckpointException")
    return cls is not None and isinstance(err, cls)


def first_failure(err: CheckpointException) -> BaseException:
    """The exception of the lowest failing rank in DCP's per-rank report."""
    return err.failures[min(err.failures)][0] if err.failures else err


def describe(err: BaseException) -> str:
    """One line for a failure: an OSError's reason and file, else `Type: message` (DCP's
    CheckpointException, which carries every rank's traceback, as the exception it wraps)."""
    if is_checkpoint_exception(err):
        return describe(first_failure(err))
    if isinstance(err, OSError) and err.strerror:
        where = f" at {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    cause = err.__cause__ or err.__context__
    if isinstance(cause, OSError):
        return describe(cause)
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def reraise_interrupt(err: CheckpointException) -> None:
    """DCP wraps whatever a rank raised, Ctrl-C included: let an interrupt stay an interrupt."""
    inner = first_failure(err)
    if isinstance(inner, (KeyboardInterrupt, SystemExit)):
        raise inner


def load(state: dict[str, Any], folder: str | Path) -> None:
    """dcp.load(state) from `folder` in place, through SafeReader and SafePlanner (every rank
    calls it; DCP plans over the default process group). A failure on any rank raises a
    one-line CheckpointError on every rank (UnsafeCheckpoint for a refused object)."""
    # deferred: DCP (~1.8 s), see the top of this module
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # (the same)

    folder = Path(folder)
    reader, planner = safe_io()
    try:
        dcp.load(state, storage_reader=reader(folder), planner=planner(folder))
    except CheckpointException as err:
        reraise_interrupt(err)
        inner = first_failure(err)
        if isinstance(inner, CheckpointError):
            raise type(inner)(str(inner)) from None
        raise CheckpointError(f"could not read checkpoint {folder}: {describe(inner)}") from None
