"""Post-training through the session API: the caller's own sequences (`Datum`, `VideoDatum`),
SFT / GRPO / DPO losses with deferred normalization, forward-only log-probs, checkpoints, and
for video generators rollouts and DiffusionNFT / Flow-GRPO / Diffusion-DPO (docs/video-rl.md) —
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
from dit_train.posttrain.rollouts import VideoRollout, group_advantages
from dit_train.posttrain.session import NORMALIZATIONS, DoubleNormalizationError, TrainingSession
from dit_train.posttrain.video_data import VideoTransition, flow_grpo_steps, transitions
from dit_train.posttrain.video_losses import (
    DiffusionDPOLoss,
    DiffusionNFTLoss,
    FlowGRPOLoss,
    diffusion_dpo_loss,
    diffusion_nft_loss,
    flow_grpo_loss,
)

__all__ = ["NORMALIZATIONS", "VERL_LOSS_AGG_MODES", "DPOLoss", "Datum", "DiffusionDPOLoss", "DiffusionNFTLoss",
           "DoubleNormalizationError", "FlowGRPOLoss", "LossFn", "PolicyGradientLoss", "SFTLoss", "TrainingSession",
           "VideoDatum", "VideoRollout", "VideoTransition", "diffusion_dpo_loss", "diffusion_nft_loss", "dpo_loss",
           "flow_grpo_loss", "flow_grpo_steps", "group_advantages", "grpo_loss", "sequence_mean_sum_loss", "sft_loss",
           "token_mean_loss", "token_sum_loss", "transitions", "verl_loss_agg_mode"]
