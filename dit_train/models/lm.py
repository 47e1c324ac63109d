"""Causal language model built from the same transformer blocks as the DiT."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dit_train.config.choices import Mode
from dit_train.config.schema import ModelConfig
from dit_train.models.fused import RMSNorm
from dit_train.models.layers import Block, block_moe, feed_forward_linears
from dit_train.models.registry import ActivationModel, ModelSpec, register_model
from dit_train.models.rope import RotaryEmbedding


@dataclass
class LMConfig(ModelConfig):
    """The causal LM (`model.name=lm`) built from the DiT's blocks."""

    name: str = "lm"
    vocab_size: int = 256


class CausalLM(nn.Module):
    """forward(ids, pos, meta) -> logits.

    ids: [L] token ids of several documents packed together; pos: [L, 1] position inside each
    document (RoPE and the causal mask use it); meta: attention metadata (causal, per document).
    returns [L, vocab].
    """

    zero_init = ()

    def __init__(self, vocab_size: int, dim: int, depth: int, heads: int, mlp_ratio: float,
                 qk_norm: bool = True, rope_theta: float = 10000.0, backend: str = "sdpa", moe_blocks: list | None = None):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.rope = RotaryEmbedding(dim // heads, axes=1, theta=rope_theta)
        moe_blocks = moe_blocks or [None] * depth  # per block: (num_experts, top_k) or None (dense MLP)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, None, qk_norm, backend, moe=moe_blocks[i])
                                    for i in range(depth))
        self.norm = RMSNorm(dim, eps=1e-6)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        rope = self.rope(pos)
        for block in self.blocks:
            h = block(h, rope, meta)
        return self.output(self.norm(h))


def build(cfg: LMConfig, attn_backend: str = "sdpa") -> CausalLM:
    return CausalLM(vocab_size=cfg.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, mlp_ratio=cfg.mlp_ratio,
                    qk_norm=cfg.qk_norm, rope_theta=cfg.rope_theta, backend=attn_backend,
                    moe_blocks=[block_moe(i, cfg.moe) for i in range(cfg.depth)])


def _activations(off: float) -> ActivationModel:
    """Pre-RMSNorm block: 9·d + h in fp32 (the norms and GELU recomputed in backward); under
    autocast the residual stream stays fp32 (the embedding's output is): 2·d fp32 + 7·d + h in
    the compute dtype. `off` = 1 (model.recompute_prologues=false) keeps the two normed inputs and
    the GELU output too: + 2·d + h (a MoE block: + 1·d). Measured with perf.saved at d = 64, 128."""
    return ActivationModel(fp32_d=9 + 2 * off, autocast_f32_d=2, autocast_lp_d=7 + 2 * off, h_elems=1 + off,
                           outside_d=1, moe_dense_d=3 + off, moe_dense_h=off)


register_model(ModelSpec(
    name="lm", config=LMConfig, mode=Mode.llm, build=build, moe=True,
    activations=lambda cfg: _activations(float(not cfg.recompute_prologues)),
    block_linears=lambda b: [b.attn.qkv, b.attn.proj, *feed_forward_linears(b.mlp)],
    io_linears=lambda m: [m.output],  # the embedding is a lookup, not a matmul
    io_dim=lambda cfg: cfg.vocab_size, hidden=lambda cfg: int(cfg.dim * cfg.mlp_ratio),
    lora_targets=("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"),
))
