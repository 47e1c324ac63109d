"""The typed config tree (the schema of `conf/`).

Every key a user can set lives in one of these dataclasses. The root `Config` is registered
as `base_config`; each model and data source adds its own node type (`model/<name>_schema`,
`data/<name>_schema`, defined next to the model / source), so Wan's keys live in Wan's node and
a typo or a wrong type fails at composition with Hydra's own error, before anything runs.
Code below the entry point receives the sub-config it needs (`cfg.model`, `cfg.parallel`,
...), never the whole tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, List

from omegaconf import MISSING

from dit_train.config.choices import (
    AttnBackend,
    CPFSDPMode,
    Device,
    DPMode,
    InitScheme,
    Mode,
    OptimName,
    Precision,
    Prediction,
    Reduction,
    Schedule,
    TimestepSampling,
)

# The parallel degrees, outermost mesh dimension first; world size = their product. Ulysses
# (an all-to-all per attention layer, the most traffic) is innermost so its ranks are
# neighbours; data-parallel replication outermost. Everything that lists degrees (mesh,
# validation, planner layouts, layout verification) iterates over this tuple.
PARALLEL_DEGREES = ("dp_replicate", "dp_shard", "cp_ring", "cp_ulysses")


@dataclass
class ModelConfig:
    """Keys every model has. `name` picks the model from the registry (dit_train/models);
    each model's node adds its own keys (e.g. `DiTConfig`, `WanConfig`, `LMConfig`)."""

    name: str = MISSING
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    rope_theta: float = 10000.0
    qk_norm: bool = True
    init: InitScheme = InitScheme.adaln_zero
    # Attention kernel (see kernels/attention.py); auto = flash > xformers > sdpa on CUDA, sdpa on CPU.
    attn_backend: AttnBackend = AttnBackend.auto
    activation_checkpointing: bool = False


@dataclass
class VideoModelConfig(ModelConfig):
    """Keys of every video model (one that predicts a velocity for packed patch tokens)."""

    # (t, h, w) patch; tokens of a clip = (F/pt)·(H/ph)·(W/pw).
    patch_size: List[int] = field(default_factory=lambda: [2, 8, 8])
    in_channels: int = 3
    # Width of caption embeddings for cross-attention; 0 = unconditional.
    text_dim: int = 0
    text_len: int = 16
    # byte captions (pixel data without a text encoder): each byte also carries a vector of its
    # whole word, so a word is one key for cross-attention (tasks/captions.py)
    caption_words: bool = False
    # What the model's output means (a property of the weights: pretrained Wan predicts velocity).
    # velocity: v = ε − x0 itself. x0: the clean sample, turned into v = (x_t − x̂0) / max(t,
    # x0_min_t) before the loss and in the sampler: the loss is still on v, but the network never
    # has to carry the noise through its LayerNorm'ed stream (pixel-space DiTs with wide patches;
    # JiT, Li & He 2025).
    prediction: Prediction = Prediction.velocity
    x0_min_t: float = 0.05


@dataclass
class DataConfig:
    """Keys every data source has. `name` picks the source from the registry
    (dit_train/data); each source's node adds its own keys."""

    name: str = MISSING
    # Cache for generated clips, probe indexes and (by default) latents; `~` is expanded.
    cache_dir: str = "~/.cache/dit_train"
    num_workers: int = 0  # background decode threads: the next step's samples load while the model runs
    # probability a caption is replaced by the empty one (for CFG); decided by (seed, id, step)
    caption_dropout: float = 0.0


@dataclass
class ParallelConfig:
    """Layout. world size = dp_replicate · dp_shard · cp_ring · cp_ulysses."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp_ulysses: int = 1
    cp_ring: int = 1
    dp_mode: DPMode = DPMode.fsdp2
    cp_fsdp_mode: CPFSDPMode = CPFSDPMode.all
    device: Device = Device.auto
    meta_init: bool = False  # build on the meta device, shard, then initialise shards in place
    reshard_after_forward: bool = True
    # FSDP2 explicit prefetch: all-gather the next N blocks' parameters (forward) / previous N
    # (backward) ahead of use; 0 = FSDP2's implicit one-block prefetch. More overlap, more memory.
    fsdp_prefetch: int = 0
    threads_per_worker: int = 0  # torch intra-op threads per local worker; 0 = cores / local workers


@dataclass
class LauncherConfig:
    """How local workers are started when the layout needs more than one process."""

    max_restarts: int = 0  # >0: restart all workers from the latest checkpoint after a failure
    master_port: int = 0  # 0 = pick a free port
    monitor_interval: float = 0.2


@dataclass
class LossConfig:
    """Per-token weighting (see DESIGN.md) and the flow-matching objective's knobs."""

    reduction: Reduction = Reduction.sample_mean
    timestep_sampling: TimestepSampling = TimestepSampling.logit_normal
    logit_mean: float = 0.0
    logit_std: float = 1.0


@dataclass
class OptimConfig:
    name: OptimName = OptimName.adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    schedule: Schedule = Schedule.constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    global_batch: int = 8  # samples per optimizer step, whatever the layout
    grad_accum: int = 1  # accumulation groups per data-parallel rank
    micro_batch_tokens: int = 2048  # packing budget of one micro-batch (before the CP split)
    precision: Precision = Precision.fp32
    compile: bool = False
    log_every: int = 10
    progress: bool = True
    save_weights: bool = True
    ckpt_every: int = 0
    keep_last: int = 2
    resume: str = ""  # "" | auto | path to a checkpoint dir
    max_skipped_steps: int = 5
    # EMA of the trainable weights (0 = off): shadow <- d·shadow + (1-d)·w after every step taken,
    # d = min(ema_decay, (1 + n)/(10 + n)) for the n-th update (dit_train/engine/ema.py)
    ema_decay: float = 0.0
    eval_every: int = 0
    sample_every: int = 0  # validation videos every N steps (and at the end); 0 = never
    num_samples: int = 2  # clips per validation (the first readable clips: their sizes and captions)
    sample_steps: int = 20  # Euler steps of the flow-matching sampler
    guidance_scale: float = 1.0  # classifier-free guidance of validation videos (needs captions); 1 = off


# Layout keys outside `parallel`: how a rank's share of a step is cut into micro-batches.
# Changing them (like the parallel degrees) must not change the result.
TRAIN_LAYOUT_KEYS = ("grad_accum", "micro_batch_tokens")


def parallel_layout_keys() -> tuple[str, ...]:
    """Every `parallel.*` key (all of them are layout: none may change the result)."""
    return tuple(f.name for f in fields(ParallelConfig))


@dataclass
class Config:
    mode: Mode = Mode.video
    model: Any = MISSING  # a ModelConfig subclass, chosen by the model group file's schema
    data: Any = MISSING  # a DataConfig subclass, chosen by the data group file's schema
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Filled by the entry point with Hydra's run dir (one dir for all ranks; rank 0 writes).
    run_dir: str = ""
