"""Single-device attention kernels behind one varlen interface (see attention.py)."""
from kernels.attention import (
    BACKENDS,
    LocalAttention,
    VarlenMeta,
    attention_mask,
    attention_with_lse,
    merge_partials,
    resolve_backend,
    varlen_attention,
)

__all__ = [
    "BACKENDS",
    "LocalAttention",
    "VarlenMeta",
    "attention_mask",
    "attention_with_lse",
    "merge_partials",
    "resolve_backend",
    "varlen_attention",
]
