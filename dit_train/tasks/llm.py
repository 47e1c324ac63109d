"""Causal LM task: documents -> packed, block-causal sequences -> per-token cross-entropy."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.data_pipelines.text import IGNORE
from dit_train.batch import PackedBatch


class LMTask:
    """Packs documents (one sample each); labels are shifted inside each document.

    dataset: indexable by sample id, returning an object with `.ids` [T] and `.prompt_len`.
    CP splits packs zigzag so that every rank has the same causal attention work.
    """

    causal = True
    cp_layout = "zigzag"

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def lengths(self) -> list[int]:
        return self.dataset.lengths()

    def build(self, sample_ids: list[int], step: int) -> PackedBatch:
        """The full pack of `sample_ids` (the step does not matter: no randomness), on the CPU."""
        ids, labels, pos, seg = [], [], [], []
        for k, sid in enumerate(sample_ids):
            doc = self.dataset[sid]
            x, y = doc.ids[:-1], doc.ids[1:].clone()
            y[: doc.prompt_len] = IGNORE
            n = x.numel()
            ids.append(x)
            labels.append(y)
            pos.append(torch.arange(n))
            seg.append(torch.full((n,), k, dtype=torch.long))
        if not sample_ids:
            z = torch.zeros(0, dtype=torch.long)
            return PackedBatch(seg=z, pos=z[:, None], order=z, valid=z.bool(), tokens={"ids": z, "labels": z},
                               causal=True)
        y = torch.cat(labels)
        p = torch.cat(pos)
        return PackedBatch(seg=torch.cat(seg), pos=p[:, None], order=p, valid=y != IGNORE,
                           tokens={"ids": torch.cat(ids), "labels": y},
                           sample_ids=torch.tensor(sample_ids, dtype=torch.long), causal=True)

    def per_token_loss(self, model: nn.Module, batch: PackedBatch, attn_meta: Any) -> torch.Tensor:
        """[L_local] cross-entropy of each local token (0 where the label is ignored or padding)."""
        logits = model(batch.tokens["ids"], batch.pos, attn_meta)
        labels = torch.where(batch.valid, batch.tokens["labels"], torch.full_like(batch.tokens["labels"], IGNORE))
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="none")
