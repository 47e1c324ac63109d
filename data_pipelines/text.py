"""Text corpora and byte-level tokenization for mode=llm.

Byte-level tokenization (vocab 256, id = byte value): nothing to train or download, every
corpus in every language works, and the ids are exactly reversible. The cost is ~4x longer
sequences than a BPE would give, irrelevant for the small models this runs on CPU.

A document is one sample. Documents longer than `max_doc_tokens + 1` are cut into pieces.
Inputs are ids[:-1], labels ids[1:] (shifted inside the document: nothing is predicted across
a document boundary); prompt tokens and padding get label -100 (ignored).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

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
    from pydoc_data.topics import topics

    return sorted(topics.items())


def read_corpus(path: str) -> list[tuple[str, str]]:
    """(name, text) documents of a .txt (blank-line separated paragraphs are joined into
    documents of ~2 KB) or .jsonl ({"text": ...} or {"prompt": ..., "completion": ...}) file.

    Unreadable lines of a JSONL file are skipped and counted; an unreadable file is an error.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.text_path={path}: no such file")
    try:
        raw = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"data.text_path={path} cannot be read: {e}") from e
    docs: list[tuple[str, str]] = []
    if p.suffix == ".jsonl":
        bad = 0
        for i, line in enumerate(raw.splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "prompt" in row:
                    docs.append((f"{i}\x00prompt", json.dumps([row["prompt"], row.get("completion", "")])))
                else:
                    docs.append((str(i), str(row["text"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                bad += 1
        if bad:
            log.warning("skipped %d unreadable line(s) of %s", bad, path)
        return docs
    chunk, size = [], 0
    for para in raw.split("\n\n"):
        chunk.append(para)
        size += len(para)
        if size >= 2048:
            docs.append((str(len(docs)), "\n\n".join(chunk)))
            chunk, size = [], 0
    if chunk and "".join(chunk).strip():
        docs.append((str(len(docs)), "\n\n".join(chunk)))
    return docs


def _is_heldout(name: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")
    return h / 2**32 < fraction


class TextDataset:
    """Tokenized documents (pieces of at most max_doc_tokens + 1 ids), train or held-out split.

    The split is by a hash of the document name: stable when the corpus grows.
    """

    def __init__(self, docs: list[tuple[str, str]], tokenizer: ByteTokenizer, max_doc_tokens: int,
                 split: str = "train", heldout_fraction: float = 0.02):
        if max_doc_tokens < 1:
            raise ValueError(f"data.max_doc_tokens={max_doc_tokens} must be >= 1")
        self.tokenizer = tokenizer
        self.docs: list[Document] = []
        self.skipped = 0
        for name, text in docs:
            if _is_heldout(name, heldout_fraction) != (split == "heldout"):
                continue
            if name.endswith("\x00prompt"):
                prompt, completion = json.loads(text)
                p_ids, c_ids = tokenizer.encode(prompt), tokenizer.encode(completion)
                ids, prompt_len = p_ids + c_ids, max(0, len(p_ids) - 1)
            else:
                ids, prompt_len = tokenizer.encode(text), 0
            if len(ids) < 2:  # nothing to predict
                self.skipped += 1
                continue
            step = max_doc_tokens
            for start in range(0, len(ids) - 1, step):
                piece = ids[start:start + step + 1]
                if len(piece) >= 2:
                    self.docs.append(Document(torch.tensor(piece, dtype=torch.long), max(0, prompt_len - start)))
        if not self.docs:
            raise ValueError(f"the text corpus has no usable {split} document (all empty or too short)")

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> Document:
        return self.docs[i]

    def num_tokens(self, i: int) -> int:
        """Positions in the pack: inputs are ids[:-1]."""
        return self.docs[i].ids.numel() - 1

    def lengths(self) -> list[int]:
        return [self.num_tokens(i) for i in range(len(self))]


def load_text_datasets(text_path: str, tokenizer: str, max_doc_tokens: int, heldout_fraction: float):
    """(train, heldout or None) datasets of the configured corpus."""
    docs = read_corpus(text_path) if text_path else embedded_corpus()
    if not docs:
        raise ValueError(f"the text corpus {text_path or 'pydoc_data.topics'} is empty")
    tok = build_tokenizer(tokenizer)
    train = TextDataset(docs, tok, max_doc_tokens, "train", heldout_fraction)
    try:
        heldout = TextDataset(docs, tok, max_doc_tokens, "heldout", heldout_fraction) if heldout_fraction > 0 else None
    except ValueError:
        heldout = None
    return train, heldout
