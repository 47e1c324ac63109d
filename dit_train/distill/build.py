"""A distillation run's config and its three models (docs/distillation.md).

`student_config(cfg)`: the command line's config with the teacher run's model, data, loss and
conditioning keys (what defines the model and its noise), and the student's sampler settings
(train.sample_steps = distill.student_steps, no guidance, the deterministic Euler step) so that
validation, `tools.sample` and `generate.load_run` sample the student as it was trained. Bad
input is refused here, before anything is launched, with one line naming the key.

`build_distill_run(cfg, ctx)`: the student (the teacher's weights: EMA when present, with its
optimizer, schedule and EMA), the critic (the teacher's weights, its own optimizer at
distill.critic_lr) and the frozen teacher, each built and sharded by the plain recipe
(engine/build.py), driven by a DistillTrainer.
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
from dit_train.config.schema import cond_active
from dit_train.distill.task import DistillTask
from dit_train.distill.trainer import DistillTrainer
from dit_train.engine.build import Run, build_parallel_model, build_run
from dit_train.engine.ema import EMA
from dit_train.models import build_model
from dit_train.models.init import load_full_weights


def teacher_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(full state dict, which file) of the teacher: its EMA weights when present."""
    return run_weights(folder, None)


def check_distill_keys(cfg: Config) -> None:
    """What a distillation run needs beyond each key's range (engine/checks.RANGES)."""
    d, e = cfg.distill, []
    if not d.t_min < d.t_max:
        e.append(f"distill.t_min={d.t_min}, distill.t_max={d.t_max}: need t_min < t_max")
    if str(cfg.train.precision) in ("fp16", "Precision.fp16"):
        e.append("train.precision=fp16: distillation has no loss scaling; use bf16 or fp32")
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
    if method != "dmd2":
        raise ConfigError(f"distill.method={method!r} must be none or dmd2")
    if not teacher_dir:
        raise ConfigError("distill.teacher is required by distill.method=dmd2: give the folder of a finished "
                          "training run (distill.teacher=RUN_DIR)")
    folder = Path(cfg.distill.teacher)
    where = f"distill.teacher={cfg.distill.teacher}"
    if not (folder / "config.yaml").is_file():
        raise ConfigError(f"{where}: no config.yaml there; expected a finished training run's folder "
                          f"(the hydra.run.dir of python -m dit_train)")
    check_distill_keys(cfg)
    teacher = load_config(folder)
    if teacher.mode != "video":
        raise ConfigError(f"{where}: a mode={teacher.mode} run; distillation trains few-step video generators")
    if cond_active(teacher.cond) or getattr(teacher.cond, "control", False):
        raise ConfigError(f"{where}: a conditioned run (cond.kind={teacher.cond.kind}); distillation supports "
                          f"text-to-video runs only")
    if teacher.model.lora.rank > 0:
        raise ConfigError(f"{where}: a LoRA run; distil from its merged export instead (weights.safetensors "
                          f"of a run trained without model.lora)")
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
    return dataclasses.replace(cfg, mode=teacher.mode, model=teacher.model, data=teacher.data, loss=teacher.loss,
                               cond=teacher.cond, train=train)


def build_distill_run(cfg: Config, ctx: Any = None, heldout: bool = False):
    """The distillation run of a `student_config` (see the module docstring)."""
    plain = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, teacher=""))
    student = build_run(plain, ctx, heldout=heldout)
    optim = dataclasses.replace(cfg.optim, lr=cfg.distill.critic_lr or cfg.optim.lr)
    critic = build_run(dataclasses.replace(plain, optim=optim, train=dataclasses.replace(plain.train, ema_decay=0)),
                       student.ctx, task=student.task)
    teacher = build_parallel_model(critic.cfg, student.ctx)
    teacher.requires_grad_(False)
    weights, _ = teacher_weights(Path(cfg.distill.teacher))
    for model in (student.model, critic.model, teacher):
        load_full_weights(getattr(model, "module", model), weights)  # DDP: the wrapped model's names
    if student.ema is not None:  # the EMA starts from the teacher's weights, not from the random init
        student.trainer.ema = EMA(student.model, cfg.train.ema_decay)
    task = DistillTask(student.task, cfg.distill, student.cfg.loss, cfg.train.seed)
    trainer = DistillTrainer(student.trainer, critic.trainer, teacher, task, cfg.distill)
    return DistillRun(cfg=dataclasses.replace(student.cfg, distill=cfg.distill), ctx=student.ctx, task=student.task,
                      model=student.model, optimizer=student.optimizer, scheduler=student.scheduler, trainer=trainer,
                      heldout=student.heldout, ema=student.trainer.ema, critic=critic, teacher=teacher)


@dataclass
class DistillRun(Run):
    """A Run whose checkpoints also hold the critic (its weights, optimizer, schedule, counters)."""

    critic: Any = None  # the critic's Run
    teacher: Any = None  # the frozen teacher model

    def checkpoint_parts(self) -> dict[str, Any]:
        parts = super().checkpoint_parts()
        c = self.critic
        for name, part in training_parts(c.model, c.optimizer, c.scheduler, c.trainer).items():
            parts[f"critic_{name}"] = part
        return parts
