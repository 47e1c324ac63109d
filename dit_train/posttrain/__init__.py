"""Post-training through the session API: the caller's own sequences (`Datum`, `VideoDatum`),
SFT / GRPO / DPO losses with deferred normalization, forward-only log-probs, checkpoints —
exact on every data-parallel × context-parallel layout. See docs/deferred-api.md."""
from dit_train.posttrain.datums import Datum, VideoDatum
from dit_train.posttrain.losses import (
    VERL_LOSS_AGG_MODES,
    DPOLoss,
    LossFn,
    PolicyGradientLoss,
    SFTLoss,
    dpo_loss,
    grpo_loss,
    sequence_mean_sum_loss,
    sft_loss,
    token_mean_loss,
    token_sum_loss,
    verl_loss_agg_mode,
)
from dit_train.posttrain.session import NORMALIZATIONS, DoubleNormalizationError, TrainingSession

__all__ = ["NORMALIZATIONS", "VERL_LOSS_AGG_MODES", "DPOLoss", "Datum", "DoubleNormalizationError", "LossFn",
           "PolicyGradientLoss", "SFTLoss", "TrainingSession", "VideoDatum", "dpo_loss", "grpo_loss",
           "sequence_mean_sum_loss", "sft_loss", "token_mean_loss", "token_sum_loss", "verl_loss_agg_mode"]
