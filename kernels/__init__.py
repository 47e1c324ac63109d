"""Single-device attention kernels behind one varlen interface (see attention.py)."""
from dit_train.kernels.cross_attention import packed_cross_attention
from dit_train.kernels.attention import (
    BACKENDS,
    LocalAttention,
    VarlenLayout,
    attention_mask,
    attention_with_lse,
    merge_partials,
    resolve_backend,
    varlen_attention,
)

__all__ = [
    "BACKENDS",
    "LocalAttention",
    "VarlenLayout",
    "attention_mask",
    "attention_with_lse",
    "merge_partials",
    "packed_cross_attention",
    "resolve_backend",
    "varlen_attention",
]
