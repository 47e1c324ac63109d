"""The conditioning node of the config tree (`cond`, docs/conditioning.md) and what the code asks
of it: whether clips are conditioned, through which feed, how many input channels it adds, which
companion files a clip needs. Every comparison of cond.kind / cond.feed / cond.given_stream to a
name is here (CondConfig's properties), so a new kind or feed is one change in this file."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dit_train.config.choices import CondFeed, CondKind, GivenStream


# Mask channels of the concat feed: one per frame of the model's input. Wan 2.1 I2V on latents
# packs the masks of the 4 pixel frames of each latent frame into 4 channels (36 = 16 + 4 + 16);
# a latent-cache conditioning would set 4 here (the next step of issue 32).
MASK_CHANNELS = 1


def cond_active(cond: Any) -> bool:
    """`cond` conditions clips on their own frames (None, as a task built without one: no)."""
    return cond is not None and cond.active


def cond_channels(cond: Any, in_channels: int, mask_channels: int = MASK_CHANNELS, control: int | None = None) -> int:
    """Input channels added per token: the concat feed's mask (`mask_channels`: 1, or Wan 2.1
    I2V's 4) plus C conditioning channels, then `control` channels of the control video
    (cond.control; default C, a VACE model's context width: control_channels); 0 for the
    timestep feed without control, and without conditioning (model.cond_channels; the
    conditioning itself is dit_train/tasks/conditioning.py)."""
    concat = in_channels + mask_channels if cond is not None and cond.concat_feed else 0
    return concat + ((in_channels if control is None else control) if getattr(cond, "control", False) else 0)


def control_channels(model: Any) -> int:
    """Channels the control video adds per token with cond.control: the model's C, or for Wan
    VACE its context [inactive C | reactive C | mask] (models/wan_vace.py, `control_channels`)."""
    width = getattr(model, "control_channels", None)
    return width() if callable(width) else getattr(model, "in_channels", 0)


def companions(data: Any, cond: Any) -> tuple[str, ...]:
    """The files a clip needs beside it for this config: "mask" (data.masks), "control"
    (cond.control); what the data source must give (data_pipelines/companions.py)."""
    return (("mask",) if getattr(data, "masks", False) else ()) + (("control",) if getattr(cond, "control", False) else ())


@dataclass
class CondConfig:
    """Conditioned video training (docs/conditioning.md): context frames taken from the clip
    itself, given to the model clean and never scored (loss weight 0, out of T_b)."""

    kind: CondKind = CondKind.none  # none | first_frame | first_last | prefix
    # share of samples conditioned at a step (the others train text-to-video), decided by
    # (seed, sample id, step) like caption dropout: one model serves both (NeMo's i2v_prob)
    prob: float = 1.0
    # kind=prefix: the clip's first frames given, in the data's frames (pixel frames, or latent
    # frames on a latent cache); a multiple of model.patch_size[0]; 0 = one temporal patch
    prefix_frames: int = 0
    feed: CondFeed = CondFeed.timestep  # timestep | concat
    # an aligned control video (edges, depth, pose: clip.control.mp4 beside each clip, or the
    # manifest's `control` column) given as C more input channels after the concat feed's, on
    # every sample; works with any kind, none included (docs/conditioning.md#control)
    control: bool = False
    # cross-stream conditioning of a model with an audio stream (docs/audio-video.md): none, video
    # (video-to-audio: a clip's video given clean at timestep 0, weight 0, out of T_{b,video}; its
    # sound generated) or audio (audio-to-video, likewise); for a clip with sound, with
    # probability given_stream_prob decided by (seed, sample id, step), so every layout agrees
    given_stream: GivenStream = GivenStream.none  # none | video | audio
    given_stream_prob: float = 0.5

    # What the code asks of a cond, answered here only: elsewhere no code compares cond.kind or
    # cond.feed to a name, so a new kind or feed is one change in this class.
    @property
    def active(self) -> bool:
        """Clips are conditioned on their own frames (kind is not none)."""
        return self.kind != CondKind.none

    @property
    def cross_stream(self) -> bool:
        """One stream of a clip with sound is given clean (given_stream is not none)."""
        return self.given_stream != GivenStream.none

    @property
    def gives_video(self) -> bool:
        """Video-to-audio: a clip's frames are given, its sound generated."""
        return self.given_stream == GivenStream.video

    @property
    def gives_audio(self) -> bool:
        """Audio-to-video: a clip's sound is given, its frames generated."""
        return self.given_stream == GivenStream.audio

    @property
    def concat_feed(self) -> bool:
        """Conditioned through input channels: [mask | conditioning frames] after the noisy ones
        (Wan 2.1 I2V); every token stays a target."""
        return self.active and self.feed == CondFeed.concat

    @property
    def timestep_feed(self) -> bool:
        """Conditioned through clean context tokens at timestep 0 (Wan 2.2 TI2V): weight 0, out of T_b."""
        return self.active and self.feed == CondFeed.timestep

    @property
    def active_feed(self) -> str:
        """cond.feed when the run is conditioned, "" when not."""
        return str(self.feed) if self.active else ""

    @property
    def gives_last(self) -> bool:
        """The last temporal patch is given too (FLF2V: first_last)."""
        return self.kind == CondKind.first_last

    @property
    def from_prefix(self) -> bool:
        """The first prefix_frames frames are given (continue a video: prefix)."""
        return self.kind == CondKind.prefix

    @property
    def from_images(self) -> bool:
        """The given frames are images: the first (first_frame), or the first and last (first_last)."""
        return self.kind in (CondKind.first_frame, CondKind.first_last)

    @property
    def context_key(self) -> str:
        """The key that sets how much context is given: cond.prefix_frames for prefix, else cond.kind."""
        return f"cond.prefix_frames={self.prefix_frames}" if self.from_prefix else f"cond.kind={self.kind}"
