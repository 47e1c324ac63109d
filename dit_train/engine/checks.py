"""Checks that run before any worker starts; each error says what to change.

Enumerated keys are checked against the schema itself (every field typed with a `Choice`
enum), numeric ranges and combinations here, model-specific rules by the model's spec.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import typing
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dit_train.config import PARALLEL_DEGREES, Config
from dit_train.config.choices import ActivationCheckpointing, Choice
from dit_train.config.errors import ConfigError, check
from dit_train.data_pipelines import SOURCES
from dit_train.engine.one_gpu_checks import one_gpu_errors, runs_on_cuda
from dit_train.models import build_model, lora_formats, model_spec, MODELS
from dit_train.parallel.mesh import ParallelDims
from dit_train.tasks.causal import causal_errors
from dit_train.tasks.conditioning import cond_errors
from dit_train.trackers import tracker_errors


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    # resolving string annotations is most of a check's cost; the planner checks thousands of layouts
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def _choice_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, its Choice type or None) of each field of the dataclass `cls`."""
    hints = _type_hints(cls)
    return tuple((f.name, kind if isinstance(kind := hints.get(f.name), type) and issubclass(kind, Choice) else None)
                 for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _is_node(cls: type) -> bool:
    # per type, not per value: dataclasses.is_dataclass was a third of a check's cost
    return dataclasses.is_dataclass(cls)


def choice_errors(node: Any, prefix: str) -> list[str]:
    """Values of `Choice`-typed fields (recursively) that are not among the allowed ones.

    Composition already enforces this for configs made by Hydra; configs built in Python
    (dataclass constructors, `dataclasses.replace`) are checked here."""
    errors = []
    for name, kind in _choice_fields(type(node)):
        value = getattr(node, name)
        if _is_node(type(value)):
            errors += choice_errors(value, f"{prefix}{name}.")
        elif kind is not None and value not in kind.values():
            errors.append(f"{prefix}{name}={value!r} must be one of {', '.join(kind.values())}")
    return errors


def _parallel(cfg: Config, world_size: int | None, e: list[str]) -> None:
    p, m = cfg.parallel, cfg.model
    for key in PARALLEL_DEGREES:
        check(getattr(p, key) >= 1, f"parallel.{key}={getattr(p, key)} must be >= 1", e)
    dims = ParallelDims.from_config(p)
    if world_size is not None and world_size != dims.world:
        e.append(f"the launcher started {world_size} processes but {dims.describe()}; make the product of "
                 f"parallel.{'/'.join(PARALLEL_DEGREES)} equal {world_size} (e.g. parallel.dp_shard={world_size})")
    check(p.fsdp_prefetch >= 0, f"parallel.fsdp_prefetch={p.fsdp_prefetch} must be >= 0 (0 = FSDP2's implicit prefetch)", e)
    if m.heads >= 1:  # model.heads < 1 is a range error already (and the modulo would divide by zero)
        check(m.dim % m.heads == 0, f"model.dim={m.dim} must be divisible by model.heads={m.heads}", e)
    check(p.cp_ulysses >= 1 and m.heads % max(1, p.cp_ulysses) == 0,
           f"model.heads={m.heads} must be divisible by parallel.cp_ulysses={p.cp_ulysses} (Ulysses splits heads)", e)
    audio_heads = getattr(m, "audio_heads", 0)  # LTX-2's audio stream and its audio<->video attention
    check(not audio_heads or audio_heads % max(1, p.cp_ulysses) == 0,
           f"model.audio_heads={audio_heads} must be divisible by parallel.cp_ulysses={p.cp_ulysses} (Ulysses splits "
           "the audio attention's heads too)", e)
    check(not (p.dp_mode == "ddp" and p.meta_init),
           "parallel.meta_init=true needs FSDP2 (DDP needs full weights on every rank); set parallel.dp_mode=fsdp2 "
           "or parallel.meta_init=false", e)
    check(not (p.dp_mode == "none" and p.meta_init), "parallel.meta_init=true needs parallel.dp_mode=fsdp2", e)
    # one process is not wrapped in FSDP2 (parallelize moves it with .to(), which meta tensors refuse)
    check(not (p.dp_mode == "fsdp2" and p.meta_init and dims.world == 1),
           "parallel.meta_init=true needs FSDP2 over >= 2 ranks (one process is not sharded: nothing would "
           "materialize the meta-device weights); set parallel.meta_init=false or raise parallel.dp_shard", e)
    # FSDP2's CPUOffloadPolicy is the only parameter offload: DDP keeps full copies on the device,
    # and a single process is not wrapped in FSDP2 at all
    check(not (p.cpu_offload and p.dp_mode != "fsdp2"),
           f"parallel.cpu_offload=true needs FSDP2 (parallel.dp_mode={p.dp_mode} keeps parameters, gradients and "
           f"optimizer state on the device); set parallel.dp_mode=fsdp2 or parallel.cpu_offload=false", e)
    check(not (p.cpu_offload and p.dp_mode == "fsdp2" and dims.world == 1),
           "parallel.cpu_offload=true needs FSDP2 over >= 2 ranks (one process is not sharded); raise parallel.dp_shard "
           "or set parallel.cpu_offload=false (train.activation_offload works on one GPU)", e)
    try:
        ActivationCheckpointing.of(m.activation_checkpointing)
    except ValueError as err:
        e.append(str(err))
    check(m.ac_every >= 1, f"model.ac_every={m.ac_every} must be >= 1 (1 = every block, 2 = every second block)", e)
    experts = m.moe.num_experts
    check(p.ep >= 1 and dims.world % max(1, p.ep) == 0,
           f"parallel.ep={p.ep} must divide the world size {dims.world} (experts are split over ep ranks of it)", e)
    check(p.ep == 1 or (experts > 0 and experts % p.ep == 0),
           f"parallel.ep={p.ep} splits the experts of MoE layers: set model.moe.num_experts to a multiple of it "
           f"(now {experts}) or parallel.ep=1", e)
    check(not (p.ep > 1 and p.cpu_offload), "parallel.ep > 1 with parallel.cpu_offload=true is not supported; "
           "set one of them back", e)


# Refused until `python -m dit_train.tools.gpu_check --only compiled_blocks` passes on a GPU:
# on an H200 (torch 2.11 + CUDA 13) the compiled blocks' forward matched eager to 1e-7 while
# half of the gradients did not (blocks.0.attn.q_norm.weight 100 % off; F.rms_norm alone compiles
# right: benchmarks/gpu/rms_norm_compile.py). A run would train on wrong gradients without a sign.
COMPILE_ON_CUDA = ("train.compile=true is refused on CUDA: the GPU check found torch.compile'd blocks' gradients "
                   "wrong there (forward right, q_norm weights 100 % off; docs/performance.md, GPU check); "
                   "train with train.compile=false")


def _train(cfg: Config, e: list[str]) -> None:
    t, o = cfg.train, cfg.optim
    for key, low in (("steps", 0), ("global_batch", 1), ("grad_accum", 1), ("micro_batch_tokens", 0), ("keep_last", 1),
                     ("max_skipped_steps", 0), ("eval_every", 0)):
        check(getattr(t, key) >= low, f"train.{key}={getattr(t, key)} must be >= {low}", e)
    # a factor <= 1 would call a loss that merely stops falling diverged (RANGES refuses < 0)
    check(not 0 < t.divergence_factor <= 1, f"train.divergence_factor={t.divergence_factor:g} must be 0 (off) or > 1 "
           f"(times the first step's loss; default 100)", e)
    check(t.ckpt_every >= 0, f"train.ckpt_every={t.ckpt_every} must be >= 0 (0 = no checkpoints)", e)
    check(t.sample_every >= 0, f"train.sample_every={t.sample_every} must be >= 0 (0 = no validation videos)", e)
    check(not (t.sample_every > 0 and cfg.mode != "video"),
           "train.sample_every makes validation videos (mode=video); for mode=llm use python -m dit_train.tools.generate", e)
    check(t.sample_steps >= 1 and t.num_samples >= 1,
           f"train.sample_steps={t.sample_steps} and train.num_samples={t.num_samples} must be >= 1", e)
    check(t.guidance_scale >= 1.0, f"train.guidance_scale={t.guidance_scale} must be >= 1 (1 = no guidance)", e)
    check(t.guidance_scale_2 == 0 or t.guidance_scale_2 >= 1.0,
           f"train.guidance_scale_2={t.guidance_scale_2} must be 0 (= train.guidance_scale) or >= 1", e)
    check(cfg.launcher.max_restarts >= 0, f"launcher.max_restarts={cfg.launcher.max_restarts} must be >= 0", e)
    check(not (cfg.launcher.max_restarts > 0 and t.ckpt_every == 0),
           "launcher.max_restarts > 0 restarts from the latest checkpoint, but train.ckpt_every=0 writes none; "
           "set train.ckpt_every (e.g. 100)", e)

    check(not (t.compile and runs_on_cuda(cfg.parallel.device)), COMPILE_ON_CUDA, e)
    e.extend(tracker_errors(list(t.loggers)))
    check(o.max_grad_norm >= 0, f"optim.max_grad_norm={o.max_grad_norm} must be >= 0 (0 disables clipping)", e)
    check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"optim.betas={list(o.betas)} must be two values in [0, 1)", e)


@dataclasses.dataclass(frozen=True)
class Range:
    """Where a numeric key's value must lie: finite, and within [low, high] (either end open,
    or absent). `note` says what the edge values mean."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def holds(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def describe(self) -> str:
        if self.low is None and self.high is None:
            return "a finite number"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


# Numeric keys without a rule elsewhere in this file (a key a node does not have, such as a
# model- or source-specific one, is skipped). A value outside its range, or not finite, is refused.
RANGES: dict[str, Range] = {
    "model.dim": Range(1), "model.depth": Range(1), "model.heads": Range(1),
    "model.mlp_ratio": Range(0, low_open=True), "model.rope_theta": Range(0, low_open=True),
    "model.in_channels": Range(1), "model.vocab_size": Range(1),
    "model.ffn_dim": Range(0, note="0 = model.dim x model.mlp_ratio"), "model.freq_dim": Range(1),
    "model.norm_eps": Range(0, low_open=True),
    "model.sync_scale": Range(0, low_open=True, note="the sync feature's input scale (model.sync_encoder)"),
    "model.head_dim": Range(1), "model.refiner_depth": Range(0), "model.time_hidden": Range(1),
    "model.time_dim": Range(1), "model.rope_freq_dim": Range(1),
    "model.boundary_ratio": Range(0, 1, high_open=True, note="0 = no expert boundary (Wan 2.2 A14B: 0.875)"),
    "model.image_dim": Range(0, note="0 = no CLIP image branch (Wan 2.1 I2V: 1280)"),
    "model.pos_embed_seq_len": Range(0, note="0 = none (Wan 2.1 FLF2V: 514)"),
    "model.mask_channels": Range(1, note="1 = one mask channel; Wan 2.1 I2V: 4"),
    "model.lora.rank": Range(0, note="0 = no adapters"), "model.lora.alpha": Range(0, note="0 = the rank"),
    "model.lora.dropout": Range(0, 1, high_open=True),
    "data.num_workers": Range(0, note="0 = decode in the training thread"),
    "data.max_dropped_fraction": Range(0, 1, note="the share of unreadable samples a run tolerates"),
    "data.num_clips": Range(1), "data.num_images": Range(0), "data.max_frames": Range(1), "data.frame_stride": Range(1),
    "data.fps": Range(0, note="0 = the clip's own rate"), "data.decoded_cache_items": Range(0),
    "data.max_doc_tokens": Range(1),
    "data.shard_cache_gb": Range(0, note="0 = read byte ranges only"), "data.read_retries": Range(0),
    "data.retry_backoff_s": Range(0),
    "parallel.threads_per_worker": Range(0, note="0 = cores / local workers"),
    "parallel.timeout_s": Range(0, low_open=True),
    "launcher.master_port": Range(0, 65535, note="0 = a free port"),
    "launcher.monitor_interval": Range(0, low_open=True),
    "launcher.heartbeat_timeout_s": Range(0, note="0 = off"),
    "loss.logit_mean": Range(), "loss.logit_std": Range(0, low_open=True),
    "loss.stream_weights.video": Range(0), "loss.stream_weights.audio": Range(0),
    "cond.given_stream_prob": Range(0, 1),
    "optim.lr": Range(0, low_open=True), "optim.weight_decay": Range(0),
    "optim.eps": Range(0, low_open=True), "optim.momentum": Range(0, 1, high_open=True),
    "optim.muon_momentum": Range(0, 1, high_open=True),
    "optim.warmup_steps": Range(0), "optim.min_lr_ratio": Range(0, 1),
    "train.log_every": Range(1), "train.seed": Range(0, note="numpy and torch generators take non-negative seeds"),
    "data.gen_seed": Range(0), "train.ema_decay": Range(0, 1, high_open=True, note="0 = off"),
    "train.divergence_factor": Range(0, note="0 = off; else > 1, times the first step's loss"),
    "distill.student_steps": Range(1), "distill.student_every": Range(1, note="critic steps per student step"),
    "distill.teacher_guidance": Range(0, note="1 = off"), "distill.critic_lr": Range(0, note="0 = optim.lr"),
    "distill.t_min": Range(0, 1, low_open=True, high_open=True), "distill.t_max": Range(0, 1, low_open=True, high_open=True),
}


_GETTERS = {key: operator.attrgetter(key) for key in RANGES}  # one C getter per key: checked per planned layout


def _value(cfg: Any, key: str) -> tuple[bool, Any]:
    try:
        return True, (_GETTERS.get(key) or operator.attrgetter(key))(cfg)
    except AttributeError:  # a key of another mode's config (an LLM config has no model.patch_size)
        return False, None


def range_errors(cfg: Config) -> list[str]:
    """One line per key of RANGES whose value is outside its range (or not finite)."""
    errors = []
    for key, rule in RANGES.items():
        present, v = _value(cfg, key)
        if present and isinstance(v, (int, float)) and not rule.holds(v):
            finite = "" if math.isfinite(v) or (rule.low is None and rule.high is None) else "finite and "
            errors.append(f"{key}={v} must be {finite}{rule.describe()}" + (f" ({rule.note})" if rule.note else ""))
    return errors


def _batch_warmup(t: Any, e: list[str]) -> None:
    check(t.batch_warmup_steps >= 0, f"train.batch_warmup_steps={t.batch_warmup_steps} must be >= 0 (0 = off)", e)
    check(0 <= t.batch_warmup_start <= t.global_batch, f"train.batch_warmup_start={t.batch_warmup_start} must be "
           f"between 1 and train.global_batch={t.global_batch} (0 = global_batch // 8)", e)


def _loss(cfg: Config, e: list[str]) -> None:
    lc = cfg.loss
    check(lc.timestep_shift > 0, f"loss.timestep_shift={lc.timestep_shift} must be > 0 (1 = no shift)", e)
    check(lc.shift_reference_tokens >= 0, f"loss.shift_reference_tokens={lc.shift_reference_tokens} must be >= 0 "
           f"(0 = the same shift for every sample)", e)
    sw = lc.stream_weights
    check(not (sw.video == 0 and sw.audio == 0),  # each >= 0 and finite: RANGES
           f"loss.stream_weights video={sw.video} audio={sw.audio}: not both 0", e)


def _model_and_data(cfg: Config, e: list[str]) -> None:
    m, d = cfg.model, cfg.data
    if m.name not in MODELS:
        e.append(f"model.name={m.name!r} is not a registered model ({', '.join(MODELS.names())})")
        return
    spec = MODELS[m.name]
    check(spec.mode == cfg.mode, f"mode={cfg.mode} cannot train model={m.name} (a mode={spec.mode} model); "
           f"pick one of: {', '.join(n for n in MODELS.names() if MODELS[n].mode == cfg.mode)}", e)
    e.extend(spec.checks(m))
    if spec.diffusers is not None:  # a diffusers folder; our DiT's model.pretrained (a run) is its own check
        _pretrained(m, e)
    _moe(m, spec, e)
    if m.lora.rank > 0:
        e.extend(lora_errors(m))
    e += one_gpu_errors(cfg)
    if hasattr(m, "text_dim"):
        check(m.text_dim >= 0 and m.text_len >= 1, f"model.text_dim={m.text_dim} must be >= 0 and model.text_len="
               f"{m.text_len} >= 1", e)
    if hasattr(m, "x0_min_t"):
        check(0.0 < m.x0_min_t <= 1.0, f"model.x0_min_t={m.x0_min_t} must be in (0, 1]", e)
    if d.name not in SOURCES:
        e.append(f"data.name={d.name!r} is not a registered data source ({', '.join(SOURCES.names())})")
        return
    check(SOURCES[d.name].mode == cfg.mode, f"data={d.name} is a source for mode={SOURCES[d.name].mode}, "
           f"not mode={cfg.mode}", e)
    # the sound (VideoSample.audio) trains only the two-stream DiT's audio stream (docs/audio-video.md)
    audio_model = getattr(m, "audio_patch", 0) > 0
    check(not getattr(d, "audio", False) or audio_model, f"data.audio=true: model={m.name} has no audio stream to "
           "train on it (model=ltx2_tiny, or the two-stream DiT: model=dit model.audio_patch=500; "
           "docs/audio-video.md); set data.audio=false", e)
    spec = MODELS[m.name] if m.name in MODELS else None
    check(not audio_model or getattr(d, "audio", False) or (spec is not None and spec.silent_ok),
           f"model.audio_patch={getattr(m, 'audio_patch', 0)} trains "
           "an audio stream: set data.audio=true (the embedded set with sound, or clips with an audio column)", e)
    # both streams read the clip's caption (LTX-2: attn2 and audio_attn2; the two-stream DiT: its
    # cross-attention, per token's clip), so captions are no limit
    check(not audio_model or (not getattr(d, "masks", False) and not cfg.cond.active
                               and cfg.loss.reduction == "sample_mean"),
           f"model.audio_patch > 0 (model={m.name} with an audio stream, first slice) trains without data.masks and "
           "cond, and with loss.reduction=sample_mean (a hierarchical mean per stream)", e)
    # cond.given_stream's values are the schema's (GivenStream): composition refuses any other
    gs = cfg.cond.given_stream
    check(not cfg.cond.cross_stream or (audio_model and m.name == "dit"),
           f"cond.given_stream={gs} gives one stream of a clip with sound as clean context: it is built for the "
           f"two-stream DiT (model=dit model.audio_patch=500 data.audio=true), not model={m.name}"
           + ("" if audio_model else " without an audio stream"), e)
    # the sync feature comes from a clean picture: only video-to-audio clips have one in training
    check(not getattr(m, "sync_encoder", "") or (cfg.cond.gives_video and cfg.cond.given_stream_prob > 0),
          f"model.sync_encoder={getattr(m, 'sync_encoder', '')} reads the clean picture of video-to-audio clips: train "
          f"with cond.given_stream=video and cond.given_stream_prob > 0 (0.5: half the clips joint, half video-to-audio)", e)
    check(0.0 <= d.caption_dropout < 1.0, f"data.caption_dropout={d.caption_dropout} must be in [0, 1)", e)
    check(0.0 <= d.heldout_fraction < 1.0, f"data.heldout_fraction={d.heldout_fraction} must be in [0, 1)", e)
    check(not (cfg.train.eval_every > 0 and d.heldout_fraction <= 0),
           f"train.eval_every={cfg.train.eval_every} scores held-out samples, but data.heldout_fraction=0 holds none "
           f"out; set data.heldout_fraction (e.g. 0.1) or train.eval_every=0", e)


def _pretrained(m: Any, e: list[str]) -> None:
    """A model.pretrained folder that exists and holds safetensors weights, checked before any
    worker starts (every family; each family's checks read its config.json): a missing folder or
    one with only pickled .bin weights failed inside the workers, after the run folder was claimed."""
    path = getattr(m, "pretrained", "")
    if not path:
        return
    folder = Path(path).expanduser()
    if not folder.is_dir():
        e.append(f"model.pretrained={path} is not a folder: give a local diffusers folder (the transformer's, "
                 f"or a pipeline folder holding transformer/)")
    elif not getattr(m, "allow_pickle_weights", False) and not any(folder.rglob("*.safetensors")):
        e.append(f"model.pretrained={path} holds no .safetensors weights (pickled .bin/.pt only?): convert them, or "
                 f"set model.allow_pickle_weights=true on the command line if you trust the folder's source")


def _moe(m: Any, spec: Any, e: list[str]) -> None:
    moe = m.moe
    if moe.num_experts == 0:
        return
    if not spec.moe:
        e.append(f"model={m.name} has no mixture-of-experts variant; set model.moe.num_experts=0 "
                 f"(MoE: model=dit_tiny/dit_small/dit_1b or mode=llm)")
        return
    check(moe.num_experts >= 2, f"model.moe.num_experts={moe.num_experts} must be 0 (dense) or >= 2", e)
    check(1 <= moe.top_k <= max(1, moe.num_experts),
           f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}", e)
    check(1 <= moe.every <= m.depth, f"model.moe.every={moe.every} must be between 1 (every block) and "
           f"model.depth={m.depth} (otherwise no block has experts)", e)
    check(moe.aux_loss_coef >= 0 and moe.z_loss_coef >= 0, f"model.moe.aux_loss_coef={moe.aux_loss_coef} and "
           f"model.moe.z_loss_coef={moe.z_loss_coef} must be >= 0", e)
    check(m.lora.rank == 0, f"model.lora.rank={m.lora.rank} with model.moe.num_experts={moe.num_experts}: LoRA "
           f"adapters on stacked expert weights are not supported; train the MoE model fully (model.lora.rank=0)", e)


def _init_from_layout(m: Any, path: Path) -> list[str]:
    """model.lora.init_from in ComfyUI's / kohya's layout needs the model's key map (its names
    alone are read here; the tensors when the model is built)."""
    try:
        with safe_open(str(path), "pt") as f:
            names = dict.fromkeys(f.keys())
    except (SafetensorError, OSError) as err:
        return [f"model.lora.init_from={path} is not a readable .safetensors file ({err})"]
    if not lora_formats.is_converted(names):
        return []
    try:
        lora_formats.key_map(model_spec(m))
    except ValueError as err:
        return [f"model.lora.init_from={path} is a ComfyUI / kohya LoRA, but {err}"]
    return []


def lora_errors(m: Any) -> list[str]:
    """model.lora.init and model.lora.targets against the model (built on the meta device: no
    memory, no weights). peft matches a target to a layer whose name is it or ends in ".target";
    a target that matches no linear layer is a typo (peft would ignore it, or fail with its own
    error when none matches)."""
    lo, e = m.lora, []
    check(lo.init in ("default", "gaussian"), f"model.lora.init={lo.init!r} must be default or gaussian", e)
    check(not lo.init_from or Path(lo.init_from).expanduser().is_file(),
           f"model.lora.init_from={lo.init_from} is not a file: give a LoRA .safetensors file (diffusers', or one "
           f"in ComfyUI's / kohya's layout of a family with a key map: docs/one-gpu.md)", e)
    if lo.init_from and Path(lo.init_from).expanduser().is_file():
        e += _init_from_layout(m, Path(lo.init_from).expanduser())
    if not lo.targets:
        return e

    try:
        with torch.device("meta"):
            model = build_model(m)
    except Exception:  # the model's own checks report what is wrong with its shape
        return e
    spec = model_spec(m)
    linears = [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    unmatched = [t for t in lo.targets if not any(n == t or n.endswith("." + t) for n in linears)]
    if unmatched:
        kinds = sorted({".".join(n.split(".")[-2:]) for n in linears})
        default = spec.lora_targets
        e.append(f"model.lora.targets: {', '.join(map(repr, unmatched))} {'matches' if len(unmatched) == 1 else 'match'} no linear layer of model={m.name} "
                 f"(its layers end in {', '.join(kinds[:12])}{', ...' if len(kinds) > 12 else ''}); "
                 f"[] = the default set [{default if isinstance(default, str) else ','.join(default)}]")
    return e


def _cond_errors(cfg: Config) -> list[str]:
    return cond_errors(str(cfg.mode), cfg.cond, cfg.model, cfg.data)


def warnings_for(cfg: Config) -> list[str]:
    """Settings that run but probably do not do what the user wants."""
    w = []
    t, m = cfg.train, cfg.model
    if t.guidance_scale > 1 and t.sample_every > 0 and getattr(m, "text_dim", 0) and cfg.data.caption_dropout <= 0:
        w.append(f"train.guidance_scale={t.guidance_scale:g} with data.caption_dropout=0: the model never learns the "
                 f"empty caption that guidance contrasts with; set data.caption_dropout=0.1 (or train.guidance_scale=1)")
    lc = cfg.loss
    if cfg.mode != "video" and (lc.timestep_shift != 1 or lc.shift_reference_tokens or lc.weighting != "none"):
        w.append(f"loss.timestep_shift, loss.shift_reference_tokens and loss.weighting shape the flow-matching loss "
                 f"(mode=video); mode={cfg.mode} ignores them")
    return w


def check_config(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem found (and log warnings for settings that run but
    probably do not do what is wanted). `world_size`: processes already started by an outside
    launcher (torchrun / SLURM), or None when we start them ourselves."""
    for message in warnings_for(cfg):
        logging.getLogger(__name__).warning(message)
    e = choice_errors(cfg, "")
    e += range_errors(cfg)
    _parallel(cfg, world_size, e)
    _train(cfg, e)
    _batch_warmup(cfg.train, e)
    _loss(cfg, e)
    _model_and_data(cfg, e)
    e += _cond_errors(cfg)
    e += causal_errors(str(cfg.mode), cfg.model, cfg.data, cfg.loss, cfg.cond)
    if e:
        # one problem: one line; several: one line each under the heading
        text = f"invalid configuration: {e[0]}" if len(e) == 1 else "invalid configuration:\n  - " + "\n  - ".join(e)
        raise ConfigError(text, e)
