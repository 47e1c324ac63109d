from dit_train.loss.counts import sync_counts, sync_expert_counts, sync_sequence_sums
from dit_train.loss.reductions import (
    EXACT_REDUCTIONS,
    REDUCTIONS,
    StepCounts,
    inverse_sample_tokens,
    token_weights,
    weighted_loss,
)

__all__ = ["EXACT_REDUCTIONS", "REDUCTIONS", "StepCounts", "inverse_sample_tokens", "sync_counts", "sync_expert_counts",
           "sync_sequence_sums",
           "token_weights", "weighted_loss"]
