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
from typing import Any, List, Union

from omegaconf import MISSING

from dit_train.config.choices import (
    ActivationCheckpointing,
    AttnBackend,
    BaseQuant,
    Balance,
    BlockNoiseSchedule,
    CPFSDPMode,
    Device,
    DPMode,
    FrameNoise,
    InitScheme,
    LossWeighting,
    Mode,
    OptimName,
    Precision,
    Prediction,
    Reduction,
    Schedule,
    TimestepSampling,
    WandbMode,
)
from dit_train.config.cond import MASK_CHANNELS, CondConfig, cond_channels, control_channels

# The parallel degrees, outermost mesh dimension first; world size = their product. Ulysses
# (an all-to-all per attention layer, the most traffic) is innermost so its ranks are
# neighbours; data-parallel replication outermost. Everything that lists degrees (mesh,
# validation, planner layouts, layout verification) iterates over this tuple.
PARALLEL_DEGREES = ("dp_replicate", "dp_shard", "cp_ring", "cp_ulysses")


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the model's linear layers; rank 0 = off (full training)."""

    rank: int = 0  # adapter rank; 0 = no adapters, every weight trains
    alpha: float = 0.0  # scale = alpha / rank; 0 = rank (scale 1)
    dropout: float = 0.0  # dropout on the adapter input (not layout-invariant: keep 0 for exact runs)
    targets: List[str] = field(default_factory=list)  # module-name suffixes to adapt; [] = the model's default set
    init: str = "default"  # peft init of the adapters: default (A kaiming-uniform, B = 0) | gaussian
    # start the adapters from this LoRA file instead (diffusers', or ComfyUI's / kohya's layout for a
    # family with a key map: models/lora_formats.py, docs/one-gpu.md); same targets and rank; "" = init
    init_from: str = ""


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward (dit_train/models/moe.py): token-choice top-k, dropless
    (no capacity: no token is ever dropped). num_experts = 0 keeps dense MLPs."""

    num_experts: int = 0  # experts per MoE layer (each as wide as the dense MLP); 0 = dense
    top_k: int = 2  # experts per token; outputs mixed by router probabilities renormalised over the k
    every: int = 1  # MoE in every k-th block (blocks k-1, 2k-1, ...); 1 = every block
    # load-balancing loss E·Σ_i f_i·P_i of each sample (its own tokens' statistics), weighted like
    # the main loss by the reduction's global counts, averaged over MoE layers (dit_train/loss/moe.py)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0  # router z-loss: logsumexp(router logits)² per token, same weights


# the tiny CPU presets' default pixel sizes (height, width): 16:9-ish both ways and a square; at the
# tiny DiT's 2x4x4 patch a 16-frame clip is at most 2048 tokens
SMALL_BUCKETS = ((48, 80), (64, 64), (80, 48))


@dataclass
class ModelConfig:
    """Keys every model has. `name` picks the model from the registry (dit_train/models);
    each model's node adds its own keys (e.g. `DiTConfig`, `WanConfig`, `LMConfig`)."""

    name: str = MISSING
    dim: int = 128  # model width
    depth: int = 4  # transformer blocks
    heads: int = 4  # attention heads (model.dim / model.heads = head width)
    mlp_ratio: float = 4.0  # MLP hidden width = dim x mlp_ratio
    rope_theta: float = 10000.0  # RoPE base frequency
    qk_norm: bool = True  # RMSNorm on queries and keys
    init: InitScheme = InitScheme.adaln_zero  # adaln_zero (DiT) | normal (every weight random: exactness tests)
    # Attention kernel (see kernels/attention.py); auto = flash > xformers > sdpa on CUDA, sdpa on CPU.
    attn_backend: AttnBackend = AttnBackend.auto
    # none | full (keep block inputs, recompute blocks) | selective (keep matmul/attention outputs,
    # recompute the elementwise ops); true/false = full/none. Typed bool-or-str so that both spellings
    # (and old runs' config.yaml) compose; __post_init__ turns it into the policy name.
    activation_checkpointing: Union[bool, str] = ActivationCheckpointing.none.value
    ac_every: int = 1  # apply activation_checkpointing to every k-th block only (2 = every second block)
    # DiT/LM blocks: recompute the norms, adaLN modulate, GELU and gated residual in backward
    # instead of saving their outputs (models/recompute.py): ~45% less block activation memory
    # for a few % more step time (measured: docs/performance.md), the same values bit for bit.
    # Off by default like the other memory options; tools.plan turns it on where memory is short.
    # Wan's diffusers blocks have no prologues (no effect there).
    recompute_prologues: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    # LoRA runs: the frozen linears of the blocks stored by torchao as int8, fp8 (a scale per row),
    # fp8_scaled (a scale per 64 inputs; 1 B per weight instead of 2-4) or nf4 (~0.52 B); adapters,
    # norms, embeddings keep the training dtype; dit_train/models/quant.py, docs/one-gpu.md. Needs
    # model.lora.rank > 0 and torchao (the quant extra); nf4 also every frozen block weight's size a
    # multiple of 64, fp8_scaled every input width.
    base_quant: BaseQuant = BaseQuant.none
    # LoRA runs on one device: the frozen weights of the last N blocks kept in host memory (pinned on
    # CUDA) and copied to the device ahead of each block's forward and backward (side stream on CUDA;
    # dit_train/engine/block_swap.py, docs/one-gpu.md). Needs full activation checkpointing on those
    # blocks; one process (over several ranks: FSDP2's parallel.cpu_offload).
    block_swap: int = 0
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, bool):  # a bad name is reported by check_config
            self.activation_checkpointing = ActivationCheckpointing.of(self.activation_checkpointing)


@dataclass
class VideoModelConfig(ModelConfig):
    """Keys of every video model (one that predicts a velocity for packed patch tokens)."""

    # (t, h, w) patch; tokens of a clip = (F/pt)·(H/ph)·(W/pw).
    patch_size: List[int] = field(default_factory=lambda: [2, 8, 8])
    in_channels: int = 3  # 3 for pixels, the VAE's latent channels for data=latent_cache
    # Width of caption embeddings for cross-attention; 0 = unconditional.
    text_dim: int = 0
    text_len: int = 16  # caption tokens kept per sample
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
    # Input channels added to the patch embedding by cond.feed=concat (the conditioning frames and
    # their mask, dit_train/tasks/conditioning.py) and cond.control (the control video): derived
    # from `cond` when the config is built; 0 without either. Never set by hand (check_config refuses a value cond does not give).
    cond_channels: int = 0
    # (height, width) pixel sizes your videos are resized to by default (cover, then centre-crop):
    # `data=video_folder`'s data.resolution_buckets follows this, so a preset brings sizes that suit
    # it (the tiny CPU models: these small ones; Wan and the latent presets: Wan 2.1's 480p)
    default_buckets: List[List[int]] = field(default_factory=lambda: [list(b) for b in SMALL_BUCKETS])


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
    # share of samples held out for the evaluation loss (train.eval_every), chosen by a hash of
    # each sample's file/document name: the same split on every machine, stable as data grows
    heldout_fraction: float = 0.0
    # a run stops (and says so) when more than this share of the samples it read could not be
    # decoded, or when a step has no readable sample at all; and is refused before step 0 when more
    # than this share of the clips were left out while the dataset was built (missing files...)
    max_dropped_fraction: float = 0.05
    # masked loss: each clip's loss weights come from its mask (a mask video beside it, clip.mask.mp4,
    # or the manifest's `mask` / `mask_boxes` columns), fractional allowed; T_b = Σ of the sample's
    # weights (docs/conditioning.md#masked-loss). Pixel video sources only
    masks: bool = False


@dataclass
class ParallelConfig:
    """Layout. world size = dp_replicate · dp_shard · cp_ring · cp_ulysses."""

    dp_replicate: int = 1  # data-parallel replicas (HSDP with FSDP2)
    dp_shard: int = 1  # FSDP2 shards (DDP ranks with dp_mode=ddp)
    cp_ulysses: int = 1  # Ulysses context parallelism (all-to-all heads <-> tokens; divides model.heads)
    cp_ring: int = 1  # ring context parallelism (K/V passed around, exact online softmax)
    # expert parallelism: the experts of each MoE layer split over ep consecutive ranks of the world
    # (tokens sent to their experts by all-to-all); divides the world size and model.moe.num_experts
    ep: int = 1
    dp_mode: DPMode = DPMode.fsdp2  # fsdp2 | ddp | none (plain model, gradients summed by hand)
    cp_fsdp_mode: CPFSDPMode = CPFSDPMode.all  # all: CP ranks join the FSDP shard group; none: separate CP sum
    device: Device = Device.auto  # auto | cpu | cuda
    meta_init: bool = False  # build on the meta device, shard, then initialise shards in place
    reshard_after_forward: bool = True  # FSDP2 frees gathered block weights after forward
    # FSDP2 explicit prefetch: all-gather the next N blocks' parameters (forward) / previous N
    # (backward) ahead of use; 0 = FSDP2's implicit one-block prefetch. More overlap, more memory.
    fsdp_prefetch: int = 0
    # FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state live in host memory
    # (the optimizer steps on the CPU); blocks are copied to the GPU when gathered. FSDP2 only.
    cpu_offload: bool = False
    threads_per_worker: int = 0  # torch intra-op threads per local worker; 0 = cores / local workers
    timeout_s: float = 600.0  # collective timeout of the process group (NCCL / gloo): a rank waiting longer fails


@dataclass
class LauncherConfig:
    """How local workers are started when the layout needs more than one process."""

    max_restarts: int = 0  # >0: restart all workers from the latest checkpoint after a failure
    master_port: int = 0  # 0 = pick a free port
    monitor_interval: float = 0.2
    # a local worker that shows no sign of life this long (frozen, stopped) is named and stopped
    # with the others (then restarted from the last checkpoint with max_restarts > 0); 0 = off
    heartbeat_timeout_s: float = 120.0


@dataclass
class StreamWeights:
    """λ per stream of the per-stream hierarchical mean (samples with audio and video:
    docs/audio-video.md); ignored by one-stream packs."""

    video: float = 1.0  # λ_video: the video stream's mean over samples that have video
    audio: float = 1.0  # λ_audio: the audio stream's mean over samples that have audio

    def as_tuple(self) -> tuple[float, ...]:
        """λ in `dit_train.batch.STREAMS` order."""
        return (float(self.video), float(self.audio))


@dataclass
class LossConfig:
    """Per-token weighting (see DESIGN.md) and the flow-matching objective's knobs."""

    reduction: Reduction = Reduction.sample_mean  # sample_mean | token_mean | sample_sum | sum | naive_mean
    timestep_sampling: TimestepSampling = TimestepSampling.logit_normal  # how the flow time t is drawn
    logit_mean: float = 0.0  # logit-normal t: mean of the logit
    logit_std: float = 1.0  # logit-normal t: std of the logit
    # shift of the drawn t: t' = s·t/(1 + (s−1)·t) (SD3/Wan; > 1 = more time at high noise; 1 = off);
    # validation and the sample tool sample with the same shift (diffusers' scheduler `shift`)
    timestep_shift: float = 1.0
    # resolution-dependent shift: a sample of T_b tokens uses timestep_shift·sqrt(T_b / this) (SD3); 0 = off
    shift_reference_tokens: int = 0
    weighting: LossWeighting = LossWeighting.none  # none | sigma_sqrt | cosmap: w(t) times each token's loss
    # λ per stream: L = Σ_s λ_s·(1/B_s)·Σ_{b has s} (1/T_{b,s})·Σ_t w·l (sample_mean of multi-stream packs)
    stream_weights: StreamWeights = field(default_factory=StreamWeights)
    # diffusion forcing (block-causal models, docs/causal.md): clip = one t per clip; block = each
    # causal block of a clip draws its own t (from the clip's own generator: the same in every layout)
    frame_noise: FrameNoise = FrameNoise.clip
    # frame_noise=block: independent draws, or the same draws sorted so t never falls along time
    block_noise_schedule: BlockNoiseSchedule = BlockNoiseSchedule.independent
    # frame_noise=block: the share of clips (of 2+ blocks) whose first h blocks (h uniform in
    # 1..blocks−1) are clean history: t = 0, weight 0, outside T_b; 0 = every block supervised
    history_prob: float = 0.0


@dataclass
class OptimConfig:
    # adamw | adamw8bit (AdamW with 8-bit moments, torchao: dit_train/optim/low_bit.py) | muon (Muon on
    # the blocks' 2-D weights, AdamW on the rest: dit_train/optim/muon.py) | sgd
    name: OptimName = OptimName.adamw
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0  # decoupled (AdamW) / L2 (SGD) weight decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8  # AdamW epsilon
    momentum: float = 0.0  # SGD momentum
    muon_momentum: float = 0.95  # Muon's Nesterov momentum (optim.name=muon)
    max_grad_norm: float = 1.0  # 0 disables clipping
    schedule: Schedule = Schedule.constant  # LR after warm-up: constant | cosine | linear (to min_lr_ratio)
    warmup_steps: int = 0  # linear LR warm-up steps
    min_lr_ratio: float = 0.1  # LR floor of cosine/linear, as a share of optim.lr


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps
    seed: int = 0  # weights, sample order, noise and timesteps all derive from it
    global_batch: int = 8  # samples per optimizer step, whatever the layout
    grad_accum: int = 1  # accumulation groups per data-parallel rank
    # batch-size warm-up: the global batch ramps linearly from batch_warmup_start (0 = global_batch // 8,
    # at least 1) to global_batch over the first batch_warmup_steps steps (0 = off); a function of the
    # step only. The LR schedule still counts optimizer steps (the ramp does not rescale it)
    batch_warmup_steps: int = 0
    batch_warmup_start: int = 0
    # packing budget of one micro-batch (before the CP split); 0 = auto: the longest sample, at
    # least AUTO_MICRO_BATCH_TOKENS (set from the data before the run starts, so the budget follows
    # the data unless a value is given)
    micro_batch_tokens: int = 0
    # what ranks and accumulation groups are balanced by: tokens, or cost (modelled time: attention
    # grows with T_b², so equal tokens can be unequal work); only where samples go, never which
    balance: Balance = Balance.tokens
    precision: Precision = Precision.fp32  # fp32 | bf16 | fp16 (autocast; FSDP2 mixed precision on CUDA)
    compile: bool = False  # torch.compile each block (refused on CUDA: its gradients were wrong in the GPU check)
    # keep the tensors saved for backward in host memory (torch.autograd.graph.save_on_cpu around
    # forward + backward): device memory for activations ~ one block's, at the price of the copies
    activation_offload: bool = False
    log_every: int = 10  # console line every N steps (without the progress bar)
    progress: bool = True  # progress bar
    save_weights: bool = True  # write weights.safetensors (and weights_ema.safetensors) at the end
    ckpt_every: int = 0  # sharded checkpoint every N steps and at the end; 0 = none
    keep_last: int = 2  # checkpoints kept (this run's newest)
    resume: str = ""  # "" | auto | path to a checkpoint dir
    overwrite: bool = False  # start a new run in a folder holding another run (its outputs move to overwritten_<time>/)
    # resume although the data's samples changed since the checkpoint (clips added or removed:
    # the steps from the resumed one on draw from the new data); false = such a resume is refused
    resume_data_changed: bool = False
    max_skipped_steps: int = 5  # stop after more non-finite steps in a row
    # a run whose loss stays above this many times its first step's loss (per token) for 5 steps
    # in a row, or for every step after the first in a shorter run, ends failed (the loss
    # diverged: engine/sanity.py); 0 = off
    divergence_factor: float = 100.0
    # EMA of the trainable weights (0 = off): shadow <- d·shadow + (1-d)·w after every step taken,
    # d = min(ema_decay, (1 + n)/(10 + n)) for the n-th update (dit_train/engine/ema.py)
    ema_decay: float = 0.0
    eval_every: int = 0  # held-out loss every N steps (needs data.heldout_fraction > 0); 0 = never
    sample_every: int = 0  # validation videos every N steps (and at the end); 0 = never
    num_samples: int = 2  # clips per validation (the first readable clips: their sizes and captions)
    sample_steps: int = 20  # Euler steps of the flow-matching sampler
    guidance_scale: float = 1.0  # classifier-free guidance of validation videos (needs captions); 1 = off (conf/: 2)
    # the low-noise expert's guidance (model.expert=both: clips below model.boundary_ratio, as
    # WanPipeline's guidance_scale_2); 0 = train.guidance_scale
    guidance_scale_2: float = 0.0
    # validation sampler: re-noise x̂0 to the next noise level with fresh noise at every step
    # (diffusers' stochastic_sampling) instead of the deterministic Euler step (docs/quality.md)
    stochastic_sampling: bool = False
    # experiment trackers fed by rank 0 besides metrics.jsonl (dit_train/trackers): tensorboard | wandb
    loggers: List[str] = field(default_factory=lambda: ["tensorboard"])
    wandb_project: str = "dit_train"  # W&B project (train.loggers with wandb)
    wandb_mode: WandbMode = WandbMode.auto  # auto | online | offline | disabled


@dataclass
class DistillConfig:
    """DMD2 few-step distillation of a trained run (dit_train/distill, docs/distillation.md), and
    Self-Forcing: its block-causal student trained on its own rollouts (docs/causal.md)."""

    method: str = "none"  # none (plain training) | dmd2 (+experiment=distill_dmd2) | self_forcing (+experiment=self_forcing)
    # a trained run's folder (config.yaml + weights): its model, data and loss keys become this
    # run's; the student and the critic start from its weights (EMA when present)
    teacher: str = ""
    student_steps: int = 4  # the student's sampler steps (its sigmas: the Euler sampler's grid for this many)
    student_every: int = 5  # critic steps per student step (DMD2's two time-scale update rule)
    teacher_guidance: float = 1.0  # classifier-free guidance of the teacher's (real score's) x0; 1 = off
    critic_lr: float = 0.0  # the critic's learning rate; 0 = optim.lr
    t_min: float = 0.02  # the noise levels the distribution-matching gradient is taken at: uniform in [t_min, t_max]
    t_max: float = 0.98
    # the frozen teacher's shards in host memory (FSDP2's CPUOffloadPolicy; needs FSDP2 over >= 2
    # ranks and full models, not model.lora: there the teacher is the student's own base)
    teacher_offload: bool = False


# the floor of train.micro_batch_tokens=0 (auto): one micro-batch holds a whole step of the embedded
# set (8 clips of <= 320 tokens), and short samples still pack several to a micro-batch
AUTO_MICRO_BATCH_TOKENS = 4096

# Layout keys outside `parallel`: how a rank's share of a step is cut into micro-batches.
# Changing them (like the parallel degrees) must not change the result.
TRAIN_LAYOUT_KEYS = ("grad_accum", "micro_batch_tokens", "balance")


def parallel_layout_keys() -> tuple[str, ...]:
    """Every `parallel.*` key (all of them are layout: none may change the result)."""
    return tuple(f.name for f in fields(ParallelConfig))


@dataclass
class Config:
    mode: Mode = Mode.video  # video | llm
    model: Any = MISSING  # a ModelConfig subclass, chosen by the model group file's schema
    data: Any = MISSING  # a DataConfig subclass, chosen by the data group file's schema
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    cond: CondConfig = field(default_factory=CondConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    # Filled by the entry point with Hydra's run dir (one dir for all ranks; rank 0 writes).
    run_dir: str = ""

    def __post_init__(self) -> None:
        # the model's input width follows from cond.feed (model=wan_tiny cond.feed=concat just
        # works); a value set by hand that differs is left for check_config to refuse
        if isinstance(self.model, VideoModelConfig) and self.model.cond_channels == 0:
            self.model.cond_channels = cond_channels(self.cond, self.model.in_channels,
                                                     getattr(self.model, "mask_channels", MASK_CHANNELS),
                                                     control_channels(self.model))
