"""Text corpora and byte-level tokenization for mode=llm.

Byte-level tokenization (vocab 256, id = byte value): nothing to train or download, every
corpus in every language works, and the ids are exactly reversible. The cost is ~4x longer
sequences than a BPE would give, irrelevant for the small models this runs on CPU.

A document is one sample. Documents longer than `max_doc_tokens + 1` are cut into pieces.
Inputs are ids[:-1], labels ids[1:] (shifted inside the document: nothing is predicted across
a document boundary); prompt tokens and padding get label -100 (ignored).
"""
from __future__ import annotations

import json
import logging
import stat
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch

from dit_train.data_pipelines.records import (Skip, decode_utf8, describe, in_heldout, json_kind, line_column,
                                    normalize_newlines, unencodable, warn_once)

log = logging.getLogger(__name__)

IGNORE = -100


@dataclass
class Document:
    ids: torch.Tensor  # [T] int64 token ids
    prompt_len: int = 0  # the first prompt_len *labels* are ignored (prompt tokens)


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def build_tokenizer(name: str) -> ByteTokenizer:
    if name != "byte":
        raise ValueError(f"data.tokenizer={name!r}: only 'byte' is built in")
    return ByteTokenizer()


def embedded_corpus() -> list[tuple[str, str]]:
    """CPython's pydoc topics (~465 KB of English): (topic, text) in a stable order."""
    return sorted(topics.items())


@dataclass
class CorpusReport:
    """What reading a corpus left out. `skipped`: one Skip(file, line, why) per JSONL line or
    text paragraph not used (line = where the record, or its first bad byte, is). The train and
    held-out datasets of one corpus share one report: count it once."""

    file: str
    unit: str = "line"  # "line" (JSONL) or "paragraph" (text)
    records: int = 0  # non-blank lines / paragraphs read
    skipped: list[Skip] = field(default_factory=list)
    undecodable: list[Skip] = field(default_factory=list)  # those of `skipped` that are not UTF-8

    def skip(self, line: int, why: str, undecodable: bool = False) -> None:
        self.skipped.append(Skip(self.file, line, why))
        if undecodable:
            self.undecodable.append(self.skipped[-1])

    def message(self, first: int = 3) -> str:
        """'skipped 3 line(s) of corpus.jsonl: line 4: "text" is null; line 9: ...' ('' if none)."""
        return describe(self.skipped, self.unit, first)


FIX = "point data.text_path at a UTF-8 .txt or .jsonl corpus"
JSONL_HINT = 'each line must be a JSON object with a string "text", or a string "prompt" (and "completion")'


def scan_corpus(path: str, max_bad_fraction: float = 0.1) -> tuple[list[tuple[str, str]], CorpusReport]:
    """(name, text) documents of a corpus file and the report of what was left out.

    `.jsonl` (any case): one document per {"text": ...} or {"prompt": ..., "completion": ...}
    line. Any other extension is read as text: blank-line separated paragraphs joined into
    documents of ~2 KB. Left out, counted and warned about (file and line): JSONL lines that are
    not UTF-8, not JSON objects, or whose text/prompt/completion is not a string (null, a number:
    stringified they would train on "None" and "5"); text paragraphs that are not UTF-8.

    Refused (ValueError naming the file): a file holding NUL bytes or with more than
    `max_bad_fraction` of its lines/paragraphs not UTF-8 (a binary file, or another encoding:
    skipping would train on scraps of it), and a file with no usable document.
    """
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction={max_bad_fraction} must be in [0, 1]")
    data = read_corpus_bytes(path)
    jsonl = Path(path).suffix.lower() == ".jsonl"
    docs, report = (_read_jsonl if jsonl else _read_paragraphs)(path, data)
    bad = len(report.undecodable)
    if report.records and bad > max_bad_fraction * report.records:
        first = report.undecodable[0]
        raise ValueError(f"data.text_path={path} looks binary or is not UTF-8: {bad / report.records:.0%} of its "
                         f"{report.unit}s are not UTF-8 (first: line {first.line}: {first.why}); {FIX} "
                         f"(convert other encodings to UTF-8 first)")
    if not docs and report.skipped:
        raise ValueError(f"data.text_path={path} has no usable {report.unit}: {report.message()}"
                         + (f"; {JSONL_HINT}" if report.unit == "line" else ""))
    warn_once(log, report.message())
    return docs, report


CHUNK = 1 << 20  # corpus bytes read at a time: a binary file is refused at its first NUL byte, not after reading it all


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def read_corpus_bytes(path: str) -> bytes:
    """A corpus file's bytes, newlines normalized (records.normalize_newlines).

    Read in chunks of CHUNK bytes, each checked for NUL bytes as it arrives: a binary file (or
    UTF-16 text) is refused at its first chunk holding one, not after reading all of it. Only
    regular files are read: a device (/dev/zero, /dev/urandom), a named pipe or a folder is
    refused by name (a device never ends). ValueError naming data.text_path; FileNotFoundError
    when there is nothing at `path`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.text_path={path}: no such file")
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"data.text_path={path} is {_file_kind(mode)}, not a file; {FIX}")
    chunks: list[bytes] = []
    try:
        with p.open("rb") as f:
            while chunk := f.read(CHUNK):
                if b"\x00" in chunk:
                    before = normalize_newlines(b"".join(chunks) + chunk[:chunk.index(b"\x00")])
                    line = before.count(b"\n") + 1
                    raise ValueError(f"data.text_path={path} looks binary: it holds NUL bytes (first on line {line}); "
                                     f"{FIX} (UTF-16 text must be converted to UTF-8 first)")
                chunks.append(chunk)
    except OSError as e:
        raise ValueError(f"data.text_path={path} cannot be read: {e}") from e
    return normalize_newlines(b"".join(chunks))


def read_corpus(path: str, max_bad_fraction: float = 0.1) -> list[tuple[str, str]]:
    """(name, text) documents of a .txt or .jsonl corpus (see scan_corpus; left-out lines are
    warned about, not returned)."""
    return scan_corpus(path, max_bad_fraction)[0]


def _read_jsonl(path: str, data: bytes) -> tuple[list[tuple[str, str]], CorpusReport]:
    report, docs = CorpusReport(path, "line"), []
    for i, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        report.records += 1
        line, bad_at, why = decode_utf8(raw)
        if line is None:
            report.skip(i + 1, f"{why} at column {bad_at + 1}", undecodable=True)
            continue
        doc, why = _jsonl_document(i, line)
        if doc is None:
            report.skip(i + 1, why)
        else:
            docs.append(doc)
    return docs, report


def _jsonl_document(i: int, line: str) -> tuple[tuple[str, str] | None, str]:
    """(name, text) of JSONL line `i` (0-based: names are unchanged from earlier versions, so
    the held-out split is too), or (None, why it is left out)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg}: column {e.colno})"
    if not isinstance(row, dict):
        return None, f"not a JSON object ({json_kind(row)})"
    if "prompt" in row:
        keys = ("prompt", "completion")
    elif "text" in row:
        keys = ("text",)
    else:
        return None, 'no "text" (or "prompt") field'
    values = [row.get(k, "") for k in keys]  # a missing completion is the empty completion
    for key, value in zip(keys, values):
        if not isinstance(value, str):
            return None, f'"{key}" is {json_kind(value)}'
        if why := unencodable(value):
            return None, f'"{key}" {why}'
    if keys == ("text",):
        return (str(i), values[0]), ""
    return (f"{i}\x00prompt", json.dumps(values)), ""


def _read_paragraphs(path: str, data: bytes) -> tuple[list[tuple[str, str]], CorpusReport]:
    report, docs = CorpusReport(path, "paragraph"), []
    chunk, size, line = [], 0, 1  # line: where the current paragraph starts
    for raw in data.split(b"\n\n"):
        start, line = line, line + raw.count(b"\n") + 2
        report.records += bool(raw.strip())
        para, bad_at, why = decode_utf8(raw)
        if para is None:
            lines_before, column = line_column(raw, bad_at)
            report.skip(start + lines_before, f"{why} at column {column}", undecodable=True)
            continue
        chunk.append(para)
        size += len(para)
        if size >= 2048:
            docs.append((str(len(docs)), "\n\n".join(chunk)))
            chunk, size = [], 0
    if chunk and "".join(chunk).strip():
        docs.append((str(len(docs)), "\n\n".join(chunk)))
    return docs, report


class TextDataset:
    """Tokenized documents (pieces of at most max_doc_tokens + 1 ids), train or held-out split.

    The split is by a hash of the document name: stable when the corpus grows.
    `report`: what reading the corpus left out (`skipped`: its (file, line, why) list, shared by
    both splits); `too_short`: documents of this split with nothing to predict (< 2 tokens).
    """

    def __init__(self, docs: list[tuple[str, str]], tokenizer: ByteTokenizer, max_doc_tokens: int,
                 split: str = "train", heldout_fraction: float = 0.02, report: CorpusReport | None = None):
        if max_doc_tokens < 1:
            raise ValueError(f"data.max_doc_tokens={max_doc_tokens} must be >= 1")
        self.tokenizer = tokenizer
        self.report = report if report is not None else CorpusReport("<documents>", "document")
        self.docs: list[Document] = []
        self.too_short = 0
        for name, text in docs:
            if in_heldout(name, heldout_fraction) != (split == "heldout"):
                continue
            if name.endswith("\x00prompt"):
                prompt, completion = json.loads(text)
                p_ids, c_ids = tokenizer.encode(prompt), tokenizer.encode(completion)
                ids, prompt_len = p_ids + c_ids, max(0, len(p_ids) - 1)
            else:
                ids, prompt_len = tokenizer.encode(text), 0
            if len(ids) < 2:  # nothing to predict
                self.too_short += 1
                continue
            # one tensor per document (through numpy: torch.tensor reads a list of ints ~10x
            # slower), its pieces views of it: a tensor per piece from a list cost ~30 µs (the
            # embedded corpus at max_doc_tokens=64: 7321 pieces, 0.2 CPU-s per dataset, built on
            # every rank of every run); a view ~1 µs. Nothing writes into ids.
            whole = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            step = max_doc_tokens
            for start in range(0, len(ids) - 1, step):  # every piece holds >= 2 ids: start <= len(ids) - 2
                self.docs.append(Document(whole[start:start + step + 1], max(0, prompt_len - start)))
        if not self.docs:
            raise ValueError(f"the text corpus has no usable {split} document (all empty or too short)")
        self._lengths = [d.ids.numel() - 1 for d in self.docs]  # asked several times per run (plan, checks)

    @property
    def skipped(self) -> list[Skip]:
        """(file, line, why) of every corpus line/paragraph left out when reading (both splits)."""
        return self.report.skipped

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> Document:
        return self.docs[i]

    def num_tokens(self, i: int) -> int:
        """Positions in the pack: inputs are ids[:-1]."""
        return self._lengths[i]

    def lengths(self) -> list[int]:
        return list(self._lengths)


def load_text_datasets(text_path: str, tokenizer: str, max_doc_tokens: int, heldout_fraction: float,
                       max_bad_fraction: float = 0.1):
    """(train, heldout or None) datasets of the configured corpus (the embedded one when
    `text_path` is empty); both carry the corpus's `report` of left-out lines."""
    if text_path:
        docs, report = scan_corpus(text_path, max_bad_fraction)
    else:
        docs, report = embedded_corpus(), CorpusReport("pydoc_data.topics", "document")
    if not docs:
        raise ValueError(f"the text corpus {text_path or 'pydoc_data.topics'} is empty")
    tok = build_tokenizer(tokenizer)
    train = TextDataset(docs, tok, max_doc_tokens, "train", heldout_fraction, report)
    try:
        heldout = (TextDataset(docs, tok, max_doc_tokens, "heldout", heldout_fraction, report)
                   if heldout_fraction > 0 else None)
    except ValueError:
        heldout = None
    return train, heldout
