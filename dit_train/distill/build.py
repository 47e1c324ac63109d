"""A distillation run's config and its three models (docs/distillation.md).

`student_config(cfg)`: the command line's config with the teacher run's model, data, loss and
conditioning keys (what defines the model and its noise), and the student's sampler settings
(train.sample_steps = distill.student_steps, no guidance, the deterministic Euler step) so that
validation, `tools.sample` and `generate.load_run` sample the student as it was trained. Bad
input is refused here, before anything is launched, with one line naming the key.

`build_distill_run(cfg, ctx)`: the student (the teacher's weights: EMA when present, with its
optimizer, schedule and EMA), the critic (the teacher's weights, its own optimizer at
distill.critic_lr) and the frozen teacher, each built and sharded by the plain recipe
(engine/build.py), driven by a DistillTrainer. With model.lora on the command line, one model
instead: the teacher's weights as the frozen base, the student's and the critic's adapters
(distill/roles.py). The teacher's weights are read by rank 0 only and broadcast.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dit_train.checkpoint import training_parts
from dit_train.checkpoint.export import run_weights
from dit_train.compose import load_config
from dit_train.config import Config
from dit_train.config.errors import ConfigError
from dit_train.config.cond import cond_active
from dit_train.distill.roles import CRITIC, Roles
from dit_train.distill.task import DistillTask
from dit_train.distill.self_forcing import SelfForcingTrainer
from dit_train.distill.trainer import DistillTrainer
from dit_train.engine.build import Run, broadcast_full_weights, build_parallel_model, build_run
from dit_train.engine.ema import EMA
from dit_train.engine.trainer import Trainer
from dit_train.models import build_model, model_spec
from dit_train.models.lora import is_lora_name
from dit_train.optim import build_optimizer, build_scheduler
from dit_train.parallel.mesh import ParallelDims
from dit_train.tasks.causal import causal_errors, fixed_frames


def teacher_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(full state dict, which file) of the teacher: its EMA weights when present."""
    return run_weights(folder, None)


def check_distill_keys(cfg: Config) -> None:
    """What a distillation run needs beyond each key's range (engine/checks.RANGES)."""
    d, p, e = cfg.distill, cfg.parallel, []
    world = ParallelDims.from_config(p).world
    if not d.t_min < d.t_max:
        e.append(f"distill.t_min={d.t_min}, distill.t_max={d.t_max}: need t_min < t_max")
    if str(cfg.train.precision) in ("fp16", "Precision.fp16"):
        e.append("train.precision=fp16: distillation has no loss scaling; use bf16 or fp32")
    lora = cfg.model.lora.rank > 0
    if lora and p.dp_mode == "ddp" and world > 1:
        e.append(f"model.lora.rank={cfg.model.lora.rank} with parallel.dp_mode=ddp: the student's and the critic's "
                 f"adapters share one module and each backward leaves the other's unused, which DDP cannot reduce; "
                 f"use parallel.dp_mode=fsdp2")
    if d.teacher_offload and lora:
        e.append(f"distill.teacher_offload=true with model.lora.rank={cfg.model.lora.rank}: the teacher is the "
                 f"student's own frozen base there, nothing separate to offload; drop one of them")
    elif d.teacher_offload and (p.dp_mode != "fsdp2" or world == 1):
        e.append(f"distill.teacher_offload=true needs FSDP2 over >= 2 ranks (FSDP2's CPUOffloadPolicy; this layout: "
                 f"parallel.dp_mode={p.dp_mode}, {world} rank{'s' if world > 1 else ''}); raise parallel.dp_shard "
                 f"with parallel.dp_mode=fsdp2, or set distill.teacher_offload=false")
    if e:
        raise ConfigError("; ".join(e))


def student_config(cfg: Config) -> Config:
    """`cfg` made a distillation run's config (unchanged when distill.method is none)."""
    method, teacher_dir = cfg.distill.method, cfg.distill.teacher
    if method == "none":
        if teacher_dir:
            raise ConfigError(f"distill.teacher={teacher_dir} is set but distill.method=none: distil with "
                              f"+experiment=distill_dmd2 (or distill.method=dmd2)")
        return cfg
    if method not in ("dmd2", "self_forcing"):
        raise ConfigError(f"distill.method={method!r} must be none, dmd2 or self_forcing")
    if not teacher_dir:
        raise ConfigError(f"distill.teacher is required by distill.method={method}: give the folder of a finished "
                          f"training run (distill.teacher=RUN_DIR)")
    folder = Path(cfg.distill.teacher)
    where = f"distill.teacher={cfg.distill.teacher}"
    if not (folder / "config.yaml").is_file():
        raise ConfigError(f"{where}: no config.yaml there; expected a finished training run's folder "
                          f"(the hydra.run.dir of python -m dit_train)")
    check_distill_keys(cfg)
    teacher = load_config(folder)
    if teacher.mode != "video":
        raise ConfigError(f"{where}: a mode={teacher.mode} run; distillation trains few-step video generators")
    if getattr(teacher.model, "audio_patch", 0):  # its sound would be neither distilled nor generated
        raise ConfigError(f"{where}: a run with an audio stream (model.audio_patch={teacher.model.audio_patch}); "
                          f"distillation of sound is not built yet (docs/audio-video.md): distil a video-only run")
    if cond_active(teacher.cond) or getattr(teacher.cond, "control", False):
        raise ConfigError(f"{where}: a conditioned run (cond.kind={teacher.cond.kind}); distillation supports "
                          f"text-to-video runs only")
    if getattr(teacher.model, "causal_block_frames", 0):
        raise ConfigError(f"{where}: a block-causal run (model.causal_block_frames={teacher.model.causal_block_frames}); "
                          f"distillation here takes a bidirectional teacher (its real score sees the whole clip; "
                          f"Self-Forcing makes the causal student of one: docs/causal.md)")
    block = getattr(cfg.model, "causal_block_frames", 0)
    if method == "dmd2" and block:  # the student is the teacher's model: it would silently be bidirectional
        raise ConfigError(f"model.causal_block_frames={block} asks for a block-causal student, but DMD2 builds the "
                          f"student from the teacher's model ({where}: bidirectional); a causal student of a "
                          f"bidirectional teacher is Self-Forcing: +experiment=self_forcing")
    if method == "self_forcing":
        self_forcing_checks(cfg, teacher, where)
    if teacher.model.lora.rank > 0:
        raise ConfigError(f"{where}: a LoRA run (model.lora.rank={teacher.model.lora.rank} in its config.yaml); "
                          f"distil from a full-weights run (its merged weights.safetensors in a run trained without "
                          f"model.lora); model.lora on this command line puts the student and critic on adapters")
    try:
        weights, which = teacher_weights(folder)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{where}: {err} (train it to the end, or with train.save_weights=true)") from None
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in build_model(teacher.model, "sdpa").state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != shapes:
        bad = sorted(k for k in shapes.keys() | got.keys() if shapes.get(k) != got.get(k))
        raise ConfigError(f"{where}: {which} does not fit the model of its config.yaml ({bad[0]}: weights "
                          f"{got.get(bad[0])}, model {shapes.get(bad[0])}); is it another model's run?")
    train = dataclasses.replace(cfg.train, sample_steps=cfg.distill.student_steps, guidance_scale=1.0,
                                stochastic_sampling=False)
    model = dataclasses.replace(teacher.model, lora=cfg.model.lora)  # model.lora of the command line: LoRA distillation
    if method == "self_forcing":  # the teacher's weights in a block-causal student (the mask is the layout's)
        model = dataclasses.replace(model, causal_block_frames=cfg.model.causal_block_frames)
    return dataclasses.replace(cfg, mode=teacher.mode, model=model, data=teacher.data, loss=teacher.loss,
                               cond=teacher.cond, train=train)


def self_forcing_checks(cfg: Config, teacher: Config, where: str) -> None:
    """A Self-Forcing student's block against the teacher's clips (one line, before any work)."""
    k = getattr(cfg.model, "causal_block_frames", 0)
    if not k:
        raise ConfigError("distill.method=self_forcing trains a block-causal student: set model.causal_block_frames "
                          "(latent frames per causal block, e.g. 4; +experiment=self_forcing sets it)")
    student = dataclasses.replace(teacher.model, causal_block_frames=k)
    errors = causal_errors(teacher.mode, student, teacher.data, teacher.loss, teacher.cond)
    clip = fixed_frames(teacher.data, student.patch_size[0])
    if clip is not None and clip[1] < k:
        errors.append(f"model.causal_block_frames={k} is longer than the teacher's clips ({clip[0]} of {where}: "
                      f"{clip[1]} latent frames): use a block that divides {clip[1]}")
    if errors:
        raise ConfigError(f"{where} with a block-causal student: " + "; ".join(dict.fromkeys(errors)))


def build_distill_run(cfg: Config, ctx: Any = None, heldout: bool = False):
    """The distillation run of a `student_config` (see the module docstring)."""
    plain = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, teacher=""))
    lora = cfg.model.lora.rank > 0
    student = build_run(plain, ctx, heldout=heldout, adapters=(CRITIC,) if lora else ())
    ctx = student.ctx
    weights = teacher_weights(Path(cfg.distill.teacher))[0] if ctx.is_main or not ctx.distributed else {}
    if lora:  # one model: the teacher's weights as the frozen base, the student's and the critic's adapters
        models, teacher = [student.model], student.model
    else:
        critic = build_run(critic_config(plain), ctx, task=student.task)
        teacher = build_parallel_model(teacher_config(critic.cfg), ctx)
        teacher.requires_grad_(False)
        models = [student.model, critic.model, teacher]
    for model in models:  # read by rank 0 only, broadcast (engine/build.py)
        broadcast_full_weights(model, ctx, lambda: weights)
    del weights
    if student.ema is not None:  # the EMA starts from the teacher's weights, not from the random init
        student.trainer.ema = EMA(student.model, cfg.train.ema_decay)
    if lora:  # after the EMA: it holds the student's adapter only
        critic = critic_adapter_run(student, critic_config(student.cfg))
    task = DistillTask(student.task, cfg.distill, student.cfg.loss, cfg.train.seed)
    roles = Roles(student.model, critic.model, teacher)
    kind = SelfForcingTrainer if cfg.distill.method == "self_forcing" else DistillTrainer
    trainer = kind(student.trainer, critic.trainer, roles, task, cfg.distill)
    return DistillRun(cfg=dataclasses.replace(student.cfg, distill=cfg.distill), ctx=ctx, task=student.task,
                      model=student.model, optimizer=student.optimizer, scheduler=student.scheduler, trainer=trainer,
                      heldout=student.heldout, ema=student.trainer.ema, critic=critic, teacher=teacher)


def critic_config(cfg: Config) -> Config:
    """The critic's training keys: optim.* at distill.critic_lr, no EMA; bidirectional, as the
    teacher built from them (a Self-Forcing student's block is the student's alone)."""
    optim = dataclasses.replace(cfg.optim, lr=cfg.distill.critic_lr or cfg.optim.lr)
    model = cfg.model
    if getattr(model, "causal_block_frames", 0):
        model = dataclasses.replace(model, causal_block_frames=0)
    return dataclasses.replace(cfg, model=model, optim=optim, train=dataclasses.replace(cfg.train, ema_decay=0))


def teacher_config(cfg: Config) -> Config:
    """The frozen teacher's build keys: its shards in host memory with distill.teacher_offload
    (FSDP2's CPUOffloadPolicy, parallel.cpu_offload's mechanism for this model alone)."""
    if not cfg.distill.teacher_offload:
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cpu_offload=True))


def critic_adapter_run(student: Run, cfg: Config) -> Run:
    """The critic of a LoRA distillation: the `CRITIC` adapter of the student's model (added
    frozen by build_run, unfrozen here), its own optimizer, schedule and Trainer."""
    model = student.model
    params = [p for n, p in model.named_parameters() if is_lora_name(n) and f".{CRITIC}." in n]
    for p in params:
        p.requires_grad_(True)
    optimizer = build_optimizer(model, cfg.optim, params, blocks=model_spec(cfg.model).blocks(getattr(model, "module", model)))
    scheduler = build_scheduler(optimizer, cfg.optim, max(1, cfg.train.steps))
    trainer = Trainer(model, student.task, optimizer, scheduler, student.ctx, cfg.train, cfg.optim, cfg.loss,
                      cfg.parallel, cfg.model.moe)
    return Run(cfg, student.ctx, student.task, model, optimizer, scheduler, trainer)


@dataclass
class DistillRun(Run):
    """A Run whose checkpoints also hold the critic (its weights, optimizer, schedule, counters)."""

    critic: Any = None  # the critic's Run
    teacher: Any = None  # the frozen teacher model

    def checkpoint_parts(self) -> dict[str, Any]:
        parts = super().checkpoint_parts()
        c = self.critic
        for name, part in training_parts(c.model, c.optimizer, c.scheduler, c.trainer).items():
            if name == "model" and c.model is self.model:
                continue  # LoRA: the student's "model" part holds both adapters (every trainable parameter)
            parts[f"critic_{name}"] = part
        return parts
