from dit_train.loss.metadata import sync_metadata
from dit_train.loss.reductions import EXACT_REDUCTIONS, REDUCTIONS, StepMeta, token_weights, weighted_loss

__all__ = ["EXACT_REDUCTIONS", "REDUCTIONS", "StepMeta", "sync_metadata", "token_weights", "weighted_loss"]
