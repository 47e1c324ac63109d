"""`data=text`: a text corpus for mode=llm (default: CPython's pydoc topics, on every machine)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dit_train.config.choices import Mode
from dit_train.config.schema import DataConfig
from dit_train.data_pipelines.source import DataSource, register_source
from dit_train.data_pipelines.text import load_text_datasets


@dataclass
class TextConfig(DataConfig):
    name: str = "text"
    text_path: str = ""  # "" = embedded corpus (CPython's pydoc_data.topics); else .txt or .jsonl {"text": ...}
    tokenizer: str = "byte"
    max_doc_tokens: int = 512  # documents are cut into pieces of at most this many tokens
    heldout_fraction: float = 0.02  # (documents; see DataConfig)


@register_source
class TextSource(DataSource):
    name = "text"
    config = TextConfig
    mode = Mode.llm

    def open(self, split: str = "train") -> Any:
        c = self.cfg
        train, heldout = load_text_datasets(c.text_path, c.tokenizer, c.max_doc_tokens, c.heldout_fraction)
        if train.tokenizer.vocab_size > self.model_cfg.vocab_size:
            raise ValueError(f"the {c.tokenizer} tokenizer has {train.tokenizer.vocab_size} ids but "
                             f"model.vocab_size={self.model_cfg.vocab_size}; raise model.vocab_size")
        return train if split == "train" else heldout

    def fitting_keys(self, dataset: Any, budget: int) -> list[str]:
        return [f"data.max_doc_tokens={budget}"]  # a piece predicts at most max_doc_tokens tokens
