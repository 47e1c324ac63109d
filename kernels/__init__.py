"""Single-device attention kernels behind one varlen interface (see attention.py)."""
from dit_train.kernels.cross_attention import packed_cross_attention
from dit_train.kernels.attention import (
    BACKENDS,
    LocalAttention,
    VarlenLayout,
    resolve_backend,
    varlen_attention,
)
from dit_train.kernels.block_attention import block_attention_with_lse
from dit_train.kernels.blocks import SampleBlocks, sample_blocks
from dit_train.kernels.lse import MASKED, attention_mask, attention_with_lse, merge_partials

__all__ = [
    "BACKENDS",
    "LocalAttention",
    "MASKED",
    "SampleBlocks",
    "VarlenLayout",
    "attention_mask",
    "attention_with_lse",
    "block_attention_with_lse",
    "merge_partials",
    "packed_cross_attention",
    "resolve_backend",
    "sample_blocks",
    "varlen_attention",
]
