"""Causal language model built from the same transformer blocks as the DiT."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dit_train.models.fused import RMSNorm
from dit_train.models.layers import Block
from dit_train.models.rope import RotaryEmbedding


class CausalLM(nn.Module):
    """forward(ids, pos, meta) -> logits.

    ids: [L] token ids of several documents packed together; pos: [L, 1] position inside each
    document (RoPE and the causal mask use it); meta: attention metadata (causal, per document).
    returns [L, vocab].
    """

    zero_init = ()

    def __init__(self, vocab_size: int, dim: int, depth: int, heads: int, mlp_ratio: float,
                 qk_norm: bool = True, rope_theta: float = 10000.0, backend: str = "sdpa"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.rope = RotaryEmbedding(dim // heads, axes=1, theta=rope_theta)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, None, qk_norm, backend) for _ in range(depth))
        self.norm = RMSNorm(dim, eps=1e-6)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        rope = self.rope(pos)
        for block in self.blocks:
            h = block(h, rope, meta)
        return self.output(self.norm(h))
