"""What a video model receives, read once from its config and the run's `cond`.

Training (`VideoTask`), validation, `tools.sample`, the RL session and distillation all feed the
same model the same kinds of input; each used to read the model config's family-specific keys
(`mask_channels` is Wan's, `image_dim` Wan 2.1 I2V's, ...) with its own `getattr` default, and
the sampler took each of them as a parameter. `VideoInputs` is that reading, done here only.
Nothing here communicates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dit_train.config.cond import MASK_CHANNELS, cond_channels, control_channels
from dit_train.data_pipelines.audio_features import token_width
from dit_train.models.registry import model_spec


@dataclass(frozen=True)
class VideoInputs:
    """The inputs of one video model (per token unless said; C = in_channels).

    patch: (pt, ph, pw); in_channels: C of x [C, F, H, W] (pixels 3, or the VAE's latents).
    text_dim, text_len: caption embedding width (0 = unconditional) and tokens kept per sample;
    caption_words: byte captions carry their word's vector (tasks/captions.py).
    prediction, x0_min_t: what the model outputs (model.prediction) and the floor of t when an
    x̂0 is turned into a velocity. t_range: the flow times it trains on (a Wan 2.2 A14B expert's side).
    concat: conditioned through the concat feed's channels [mask | conditioning C];
    clean: conditioned through clean tokens at timestep 0 (the timestep feed); gives_last: the
    last temporal patch is given too (first_last). mask_channels: the concat feed's mask channels
    (1, or Wan 2.1 I2V's VAE temporal stride); image_dim: Wan 2.1 I2V's CLIP tokens' width.
    control: a control video as control_channels more input channels (C, or Wan VACE's context
    [inactive C | reactive C | mask vace_mask]); concat_channels: the concat feed's mask + C (0 without it).
    joint_text: the model attends over text and video together (caption tokens are pack slots).
    causal_block: temporal patches per causal block (model.causal_block_frames / pt; 0 =
    bidirectional): packs for the model are block-causal in training and sampling alike.
    audio_index: an audio token's position is its index in its clip's track (ModelSpec.audio_positions).
    audio_patch: waveform samples per audio token of a model with an audio stream (model.audio_patch;
    0 = video only): its sampler generates each clip's sound with its pictures (sampling/sound.py).
    audio_features: what an audio token holds (model.audio_features: wave | spectrogram).
    sync_encoder: the two-stream DiT's sync encoder (model.sync_encoder; '' = none): audio tokens of a
    clip whose clean picture is given carry its frame-event probabilities (tasks/av_sync.py).
    """

    patch: tuple[int, int, int]
    in_channels: int = 3
    text_dim: int = 0
    text_len: int = 16
    caption_words: bool = False
    prediction: str = "velocity"
    x0_min_t: float = 0.05
    t_range: tuple[float, float] = (0.0, 1.0)
    concat: bool = False
    clean: bool = False
    gives_last: bool = False
    mask_channels: int = MASK_CHANNELS
    image_dim: int = 0
    control: bool = False
    control_channels: int = 0
    vace_mask: int = 0
    concat_channels: int = 0
    joint_text: bool = False
    causal_block: int = 0
    audio_index: bool = False
    audio_patch: int = 0
    audio_features: str = "wave"
    sync_encoder: str = ""

    @property
    def patch_volume(self) -> int:
        """pt·ph·pw: the features a channel gives a token."""
        return math.prod(self.patch)

    @property
    def patch_dim(self) -> int:
        """Features of a token of x (and of the target): C·pt·ph·pw."""
        return self.in_channels * self.patch_volume

    @property
    def audio_width(self) -> int:
        """Features of an audio token: audio_patch samples, or their STFT frames (0 = video only)."""
        return token_width(self.audio_patch, self.audio_features)

    @property
    def cond_dim(self) -> int:
        """Features per token of the concat feed's channels (tokens["cond"]), 0 without it."""
        return self.concat_channels * self.patch_volume

    @property
    def control_dim(self) -> int:
        """Features per token of the control input (tokens["control"])."""
        return self.control_channels * self.patch_volume

    @property
    def i2v_mask(self) -> int:
        """The mask channels of diffusers' Wan 2.1 I2V layout (its condition read from a latent
        cache: tasks/conditioning.i2v_inputs); 0 for any other input."""
        return self.mask_channels if self.concat and self.mask_channels > 1 else 0

    @property
    def feed(self) -> str:
        """The conditioning's feed ("concat" | "timestep"), "" for an unconditioned model."""
        return "concat" if self.concat else "timestep" if self.clean else ""


def video_inputs(model_cfg: Any, cond: Any = None) -> VideoInputs:
    """The VideoInputs of a video model config (any family's node) and the run's CondConfig
    (None: an unconditioned task, as the RL and distillation tasks build)."""
    mask_channels = getattr(model_cfg, "mask_channels", MASK_CHANNELS)  # Wan's key: Wan 2.1 I2V sets 4
    control = bool(getattr(cond, "control", False))
    width = control_channels(model_cfg)  # C, or a VACE model's context width (models/wan_vace.py)
    concat = cond_channels(cond, model_cfg.in_channels, mask_channels, width) - (width if control else 0)
    timestep_range = getattr(model_cfg, "timestep_range", None)  # a Wan 2.2 A14B expert's side of the boundary
    return VideoInputs(
        patch=tuple(model_cfg.patch_size), in_channels=model_cfg.in_channels, text_dim=model_cfg.text_dim,
        text_len=model_cfg.text_len, caption_words=model_cfg.caption_words, prediction=str(model_cfg.prediction),
        x0_min_t=model_cfg.x0_min_t, t_range=timestep_range() if timestep_range is not None else (0.0, 1.0),
        concat=cond is not None and cond.concat_feed, clean=cond is not None and cond.timestep_feed,
        gives_last=cond is not None and cond.gives_last, mask_channels=mask_channels,
        image_dim=getattr(model_cfg, "image_dim", 0), control=control, control_channels=width,
        vace_mask=getattr(model_cfg, "vace_mask_channels", 0), concat_channels=concat,
        joint_text=bool(model_cfg.text_dim) and model_spec(model_cfg).joint_text,
        causal_block=getattr(model_cfg, "causal_block_frames", 0) // model_cfg.patch_size[0],
        audio_index=model_spec(model_cfg).audio_positions == "index", audio_patch=getattr(model_cfg, "audio_patch", 0),
        audio_features=str(getattr(model_cfg, "audio_features", "wave")),
        sync_encoder=getattr(model_cfg, "sync_encoder", ""))
