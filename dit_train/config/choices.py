"""The allowed values of every enumerated key, defined once.

Each is a `str` Enum: the schema types a key with it, so Hydra/OmegaConf reject any other
value at composition (the message lists the allowed ones), and code compares and prints it
as the plain string (`cfg.parallel.dp_mode == "fsdp2"`, f"{cfg.parallel.dp_mode}").
"""
from __future__ import annotations

import functools
from enum import Enum


class Choice(str, Enum):
    """A config choice whose members are named by their value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return _values(cls)


@functools.cache
def _values(cls: type[Choice]) -> tuple[str, ...]:
    # asked for every Choice field of every config the planner validates (thousands a plan)
    return tuple(m.value for m in cls)


class Mode(Choice):
    video = "video"  # flow-matching DiT on packed clips
    llm = "llm"  # causal LM on packed documents


class DPMode(Choice):
    fsdp2 = "fsdp2"
    ddp = "ddp"
    none = "none"  # plain model, gradients summed by hand


class CPFSDPMode(Choice):
    all = "all"  # CP ranks join the FSDP shard group
    none = "none"  # CP gradients summed by a separate all-reduce


class VideoDecoder(Choice):
    auto = "auto"  # decord where it is installed (x86_64 Linux, Windows), else PyAV
    decord = "decord"
    pyav = "pyav"
    torchcodec = "torchcodec"  # optional: pip install torchcodec (needs FFmpeg's shared libraries)


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Balance(Choice):
    """train.balance: what the step plan evens out over data-parallel ranks and accumulation
    groups (data_pipelines/packing.py); never which samples the step trains on."""

    tokens = "tokens"  # tokens per rank and group
    cost = "cost"  # modelled time (linear + attention FLOPs, dit_train/perf/cost.py)


class Reduction(Choice):
    sample_mean = "sample_mean"
    token_mean = "token_mean"
    sample_sum = "sample_sum"
    sum = "sum"
    naive_mean = "naive_mean"


class TimestepSampling(Choice):
    logit_normal = "logit_normal"
    uniform = "uniform"


class Prediction(Choice):
    velocity = "velocity"  # the model outputs v = ε − x0 (the target itself)
    x0 = "x0"  # the model outputs the clean sample; v = (x_t − x̂0) / max(t, model.x0_min_t)


class LossWeighting(Choice):
    """w(t) multiplying each token's flow-matching loss (diffusers' compute_loss_weighting_for_sd3)."""

    none = "none"  # w = 1
    sigma_sqrt = "sigma_sqrt"  # w = 1/t² (diffusers' name; large near t = 0)
    cosmap = "cosmap"  # w = 2 / (π·(1 − 2t + 2t²)), SD3's CosMap


class FrameNoise(Choice):
    """How many noise levels a clip draws (docs/causal.md)."""

    clip = "clip"  # one t for the whole clip
    block = "block"  # diffusion forcing: one t per causal block (model.causal_block_frames)


class BlockNoiseSchedule(Choice):
    """loss.frame_noise=block: how a clip's block noise levels relate along time."""

    independent = "independent"  # each block's t drawn on its own
    nondecreasing = "nondecreasing"  # the same draws sorted: t never falls along time (SkyReels-V2)


class CondKind(Choice):
    """cond.kind: which frames of a clip are given as context (dit_train/tasks/conditioning.py)."""

    none = "none"  # text-to-video only
    first_frame = "first_frame"  # image-to-video: the first temporal patch
    first_last = "first_last"  # first and last temporal patches (FLF2V)
    prefix = "prefix"  # continue a video from its first cond.prefix_frames frames


class GivenStream(Choice):
    """cond.given_stream: which stream of a clip with sound is given clean (docs/audio-video.md)."""

    none = "none"  # joint generation only
    video = "video"  # video-to-audio: the clip's frames given, its sound generated
    audio = "audio"  # audio-to-video: the clip's sound given, its frames generated


class AudioFeatures(Choice):
    """model.audio_features: what an audio token of the two-stream DiT holds (data_pipelines/audio_features.py)."""

    wave = "wave"  # its audio_patch waveform samples
    spectrogram = "spectrogram"  # their log-magnitude STFT frames (phase-free; Griffin-Lim back to sound)


class CondFeed(Choice):
    """cond.feed: how the context reaches the model."""

    timestep = "timestep"  # clean context tokens at timestep 0 per token (Wan 2.2 TI2V)
    concat = "concat"  # conditioning frames + mask concatenated to the noisy input's channels (Wan 2.1 I2V)


class OptimName(Choice):
    adamw = "adamw"
    adamw8bit = "adamw8bit"
    muon = "muon"
    sgd = "sgd"


class Schedule(Choice):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class AttnBackend(Choice):
    auto = "auto"
    sdpa = "sdpa"
    sdpa_dense = "sdpa_dense"
    flex = "flex"
    xformers = "xformers"
    flash = "flash"


class InitScheme(Choice):
    adaln_zero = "adaln_zero"  # DiT's init: modulation and output layer start at zero
    normal = "normal"  # every weight N(0, 0.02): the exactness tests need every parameter to move


class BaseQuant(Choice):
    """model.base_quant: storage of a LoRA run's frozen block linears (dit_train/models/quant.py)."""

    none = "none"  # the training dtype
    int8 = "int8"  # torchao Int8WeightOnlyConfig: int8 values, per-row scale
    fp8 = "fp8"  # torchao Float8WeightOnlyConfig: float8_e4m3fn values, per-row scale
    fp8_scaled = "fp8_scaled"  # the same with a scale per 64 inputs of each row (musubi-tuner's --fp8_scaled)
    nf4 = "nf4"  # torchao to_nf4 (QLoRA): 4-bit NormalFloat, an 8-bit absmax per 64 values


class ActivationCheckpointing(Choice):
    """model.activation_checkpointing (dit_train/parallel/checkpointing.py); true/false are
    accepted as aliases of full/none."""

    none = "none"  # every block keeps its activations
    full = "full"  # keep each block's input, recompute the whole block in backward
    selective = "selective"  # keep matmul / attention outputs, recompute the elementwise ops between them

    @classmethod
    def of(cls, value) -> str:
        """The policy name of a config value: a policy name, or a bool alias (true = full)."""
        if isinstance(value, bool):
            return (cls.full if value else cls.none).value
        try:
            return cls(str(value)).value
        except ValueError:
            raise ValueError(f"model.activation_checkpointing={value!r} must be one of {', '.join(cls.values())} "
                             f"(or true = full, false = none)") from None


class WandbMode(Choice):
    auto = "auto"  # online when W&B credentials are configured and its server answers, else offline
    online = "online"
    offline = "offline"  # files under <run folder>/wandb/, uploaded later with `wandb sync`
    disabled = "disabled"  # wandb's own no-op run
