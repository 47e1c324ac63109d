"""The typed config tree.

Every key a user can set lives in one of these dataclasses. They are registered in Hydra's
ConfigStore as the schema of `conf/` (each `conf/<group>/*.yaml` names its schema in its
defaults list), so a misspelt key or a wrong type fails at composition with Hydra's own
error, before anything runs. Code below the entry point receives the sub-config it needs
(`cfg.model`, `cfg.parallel`, ...), never the whole tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from hydra.core.config_store import ConfigStore


@dataclass
class ModelConfig:
    """Transformer shape. `name` picks the model: `dit` (packed video DiT), `wan` (diffusers'
    WanTransformer3DModel through the packed path) or `lm` (causal LM)."""

    name: str = "dit"
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    # (t, h, w) patch of the video DiT; tokens of a clip = (F/pt)·(H/ph)·(W/pw).
    patch_size: List[int] = field(default_factory=lambda: [2, 8, 8])
    in_channels: int = 3
    vocab_size: int = 256
    rope_theta: float = 10000.0
    qk_norm: bool = True
    # adaln_zero: DiT's init (modulation and output layer start at zero).
    # normal: every weight random; used by the exactness tests so that every parameter moves.
    init: str = "adaln_zero"
    # Attention kernel: auto | sdpa | sdpa_dense | flex | xformers | flash (see kernels/attention.py).
    attn_backend: str = "auto"
    activation_checkpointing: bool = False
    # Width of caption embeddings for cross-attention; 0 = unconditional.
    text_dim: int = 0
    text_len: int = 16
    # --- diffusers Wan transformer (name=wan, dit_train/models/wan.py) ---
    # Local diffusers folder (config.json + safetensors of a WanTransformer3DModel) to start
    # from; "" = initialise from train.seed. Its shape must match the keys of this config.
    pretrained: str = ""
    ffn_dim: int = 0  # feed-forward width; 0 = dim * mlp_ratio
    freq_dim: int = 256  # sinusoidal timestep features
    cross_attn_norm: bool = True  # affine LayerNorm before cross-attention
    norm_eps: float = 1e-6
    # Cross-attention sees the caption zero-padded to text_len, as Wan was trained (and as
    # diffusers' WanPipeline feeds it); false: only the context_len valid tokens.
    attend_padded_context: bool = True


@dataclass
class DataConfig:
    """Where samples come from. `name`: synthetic_video | video_folder | latent_cache | text."""

    name: str = "synthetic_video"
    # Cache for generated clips (and the default place for latents); `~` is expanded.
    cache_dir: str = "~/.cache/dit_train"
    # --- embedded synthetic video set (generated once, read back with decord) ---
    num_clips: int = 48
    gen_seed: int = 1234
    # --- video reading (any video source) ---
    root: str = ""  # video folder or manifest (csv/jsonl) for video_folder; latent dir for latent_cache
    max_frames: int = 16  # frames kept per clip after striding (cropped to a multiple of patch t)
    frame_stride: int = 1  # take every k-th frame
    fps: float = 0.0  # resample to this frame rate before striding; 0 = native
    resolution_buckets: List[List[int]] = field(default_factory=list)  # [[h, w], ...]; empty = native (cropped to patch)
    num_workers: int = 0  # background decode threads: this and the next step's samples load while the model runs
    decoded_cache_items: int = 256  # decoded clips kept in memory (the embedded set fits)
    # --- text (mode=llm) ---
    text_path: str = ""  # "" = embedded corpus (CPython's pydoc_data.topics); else .txt or .jsonl {"text": ...}
    tokenizer: str = "byte"
    max_doc_tokens: int = 512  # documents are cut into pieces of at most this many tokens
    heldout_fraction: float = 0.02
    caption_dropout: float = 0.0  # probability a caption is replaced by the empty one (for CFG); by (seed, id, step)


@dataclass
class ParallelConfig:
    """Layout. world size = dp_replicate · dp_shard · cp_ring · cp_ulysses."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp_ulysses: int = 1
    cp_ring: int = 1
    dp_mode: str = "fsdp2"  # fsdp2 | ddp | none
    cp_fsdp_mode: str = "all"  # all: CP ranks join the FSDP shard group; none: separate CP grad all-reduce
    device: str = "auto"  # auto | cpu | cuda
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

    reduction: str = "sample_mean"  # sample_mean | token_mean | sample_sum | sum | naive_mean
    timestep_sampling: str = "logit_normal"  # logit_normal | uniform
    logit_mean: float = 0.0
    logit_std: float = 1.0


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    global_batch: int = 8  # samples per optimizer step, whatever the layout
    grad_accum: int = 1  # accumulation groups per data-parallel rank
    micro_batch_tokens: int = 2048  # packing budget of one micro-batch (before the CP split)
    precision: str = "fp32"  # fp32 | bf16 | fp16
    compile: bool = False
    log_every: int = 10
    progress: bool = True
    save_weights: bool = True
    ckpt_every: int = 0
    keep_last: int = 2
    resume: str = ""  # "" | auto | path to a checkpoint dir
    max_skipped_steps: int = 5
    eval_every: int = 0
    sample_every: int = 0  # validation videos every N steps (and at the end); 0 = never
    num_samples: int = 2  # clips per validation (the first readable clips: their sizes and captions)
    sample_steps: int = 20  # Euler steps of the flow-matching sampler
    guidance_scale: float = 1.0  # classifier-free guidance of validation videos (needs captions); 1 = off


@dataclass
class Config:
    mode: str = "video"  # video | llm
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Filled by the entry point with Hydra's run dir (one dir for all ranks; rank 0 writes).
    run_dir: str = ""


def register_configs() -> None:
    """Register the schema; `conf/config.yaml` lists `base_config` first, so every group file
    is merged into a typed node and an unknown key or a wrong type is an error."""
    ConfigStore.instance().store(name="base_config", node=Config)


register_configs()
