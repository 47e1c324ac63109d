from dit_train.loss.counts import sync_counts
from dit_train.loss.reductions import (
    EXACT_REDUCTIONS,
    REDUCTIONS,
    StepCounts,
    inverse_sample_tokens,
    token_weights,
    weighted_loss,
)

__all__ = ["EXACT_REDUCTIONS", "REDUCTIONS", "StepCounts", "inverse_sample_tokens", "sync_counts", "token_weights", "weighted_loss"]
