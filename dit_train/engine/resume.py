"""The resume contract: what may change between a checkpoint's config and the resuming one.

Every changed key is one of:

- allowed: the length of the run, logging / sampling / checkpoint cadence, the parallel
  layout and micro-batching (they cannot change the result), kernels and wrappers;
- applied with a notice: optimizer hyperparameters and the LR schedule (the checkpoint's
  values would otherwise come back with the optimizer state; the notice says how the new one
  takes effect), clipping, EMA decay, evaluation settings;
- refused: what would make the resumed run a different experiment or cannot load — the seed,
  the model's shape and its LoRA adapters (model.lora.*), the optimizer type, the loss
  reduction and objective, the data's identity and the global batch. One line per key names old and new value and the fix.

Keys not listed are refused (a new key must choose its class here). Checked in the launching
process before anything in the run folder is written.
"""
from __future__ import annotations

import dataclasses
from fnmatch import fnmatch
from typing import Any

import torch

from dit_train.optim import configured_group

ALLOWED = (
    "run_dir", "train.steps", "train.log_every", "train.progress", "train.save_weights", "train.ckpt_every",
    "train.keep_last", "train.resume", "train.overwrite", "train.resume_data_changed", "train.max_skipped_steps",
    "train.divergence_factor",
    "train.sample_every",
    "train.num_samples", "train.sample_steps", "train.compile", "train.grad_accum",
    "train.micro_batch_tokens", "train.loggers", "train.wandb_project", "train.wandb_mode", "parallel.*",
    "launcher.*", "model.attn_backend",
    "model.activation_checkpointing", "model.ac_every", "data.num_workers", "data.decoded_cache_items", "data.cache_dir",
    "data.max_dropped_fraction", "train.activation_offload", "model.pretrained", "model.allow_pickle_weights",
    # how shards are reached (credentials, endpoint, local copies, retries), not which samples
    "data.storage_options", "data.storage_options.*", "data.shard_cache_gb", "data.read_retries", "data.retry_backoff_s",
    # only a default for data.resolution_buckets, which is compared on its own
    "model.default_buckets",
)
# Refused like any unlisted key, named here because the choice was made, not defaulted: the
# loss keys define the objective. A shift or weighting changed mid-run would also change what
# the logged loss and eval_loss measure from the resumed step on (cosmap scales it by up to 4/π,
# sigma_sqrt by 1/t²), and the run's config.yaml would no longer describe its weights. A
# staged schedule (e.g. a larger shift for a higher-resolution stage) is a new run folder.
# The cond keys too: which tokens are targets is the objective, and cond.feed=concat and
# cond.control change the model's input width (model.cond_channels); so is data.masks (the
# tokens' weights).
REFUSED = ("loss.reduction", "loss.timestep_sampling", "loss.logit_mean", "loss.logit_std", "loss.timestep_shift",
           "loss.shift_reference_tokens", "loss.weighting", "cond.kind", "cond.prob", "cond.prefix_frames", "cond.feed",
           "cond.control", "data.masks", "loss.frame_noise", "loss.block_noise_schedule", "loss.history_prob")
NOTICE = {
    "optim.lr": "the new peak LR replaces the old one from the resumed step on (same schedule shape: "
                "LR(step) = new optim.lr x schedule factor)",
    "optim.weight_decay": "applied to every parameter group from the resumed step on",
    "optim.betas": "applied from the resumed step on (the moment estimates keep their history)",
    "optim.eps": "applied from the resumed step on",
    "optim.momentum": "applied from the resumed step on (the momentum buffer keeps its history)",
    "optim.max_grad_norm": "clipping uses the new threshold from the resumed step on",
    "optim.schedule": "the LR follows the new schedule from the resumed step on",
    "optim.warmup_steps": "the LR follows the new warm-up from the resumed step on",
    "optim.min_lr_ratio": "the LR follows the new floor from the resumed step on",
    "train.ema_decay": "the EMA continues with the new decay (its warm-up counter is kept)",
    "train.eval_every": "held-out evaluation follows the new cadence",
    # the weights do not care, but the eval/ curve does: the same weights score differently
    "train.guidance_scale": "validation samples with the new guidance from the resumed step on (eval/ figures "
                            "before and after are not comparable)",
    "train.stochastic_sampling": "validation samples with the new sampler from the resumed step on (eval/ figures "
                                 "before and after are not comparable)",
    "train.precision": "later steps compute in the new precision (results will differ slightly from an "
                       "uninterrupted run)",
}


ABSENT = "<absent>"  # the value of a key one config's node type does not have


@dataclasses.dataclass
class Change:
    key: str
    old: Any
    new: Any
    kind: str  # allowed | notice | refused

    def line(self) -> str:
        if self.kind == "notice":
            return f"{self.key}: {self.old!r} -> {self.new!r}: {NOTICE[self.key]}"
        fix = "or start a new run folder (hydra.run.dir=...)"
        group = self.key.split(".")[0]
        if self.old == ABSENT:  # a key of another model / data source: nothing to put back
            return (f"{self.key}: the checkpoint's {group} has no such key, this run sets {self.new!r} (another "
                    f"{group}=...); resume with the checkpoint's {group} choice, {fix}")
        if self.new == ABSENT:
            return (f"{self.key}: the checkpoint was trained with {self.old!r}, this run's {group} has no such key "
                    f"(another {group}=...); resume with the checkpoint's {group} choice, {fix}")
        return (f"{self.key}: the checkpoint was trained with {self.old!r}, this run asks for {self.new!r}; "
                f"put back {self.key}={_cli(self.old)} to resume, {fix}")


def _cli(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_cli(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a (nested) config dataclass."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value.value if hasattr(value, "value") and not isinstance(value, (int, float, str)) else value
    return out


def classify(key: str) -> str:
    if key in REFUSED:
        return "refused"
    if any(fnmatch(key, pattern) for pattern in ALLOWED):
        return "allowed"
    if key in NOTICE:
        return "notice"
    return "refused"


def config_changes(old: Any, new: Any) -> list[Change]:
    """Every key whose value differs (a key only one side has counts as changed), classified.
    When model.name changed (a checkpoint of another model family), the model keys only one of
    the two has follow from that choice: the model.name line alone says what does not fit."""
    a, b = flatten(old), flatten(new)
    other_family = a.get("model.name") != b.get("model.name")
    out = []
    for key in sorted(a.keys() | b.keys()):
        va, vb = a.get(key, ABSENT), b.get(key, ABSENT)
        if other_family and key.startswith("model.") and ABSENT in (va, vb):
            continue
        if _norm(va) != _norm(vb):
            out.append(Change(key, va, vb, classify(key)))
    return out


def _norm(v: Any) -> Any:
    return [_norm(x) for x in v] if isinstance(v, (list, tuple)) else (str(v) if hasattr(v, "value") else v)


def refusal_message(ckpt: Any, refused: list[Change]) -> str:
    return (f"cannot resume {ckpt} with a different experiment:\n  - "
            + "\n  - ".join(c.line() for c in refused))


def apply_optimizer_settings(optimizer: Any, scheduler: Any, optim_cfg: Any) -> None:
    """After loading a checkpoint: the optimizer's param groups and the scheduler's base LRs come
    back with the checkpoint's values; set the configured ones (see NOTICE for how they act)."""
    for group in optimizer.param_groups:
        group.update(configured_group(group, optim_cfg))
    scheduler.base_lrs = [optim_cfg.lr for _ in scheduler.base_lrs]
    # the LambdaLR's factor functions are the new config's (a state dict holds no functions):
    # the LR of the resumed step from the new peak and the new schedule
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep it a tensor (their step needs one)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = lrs
