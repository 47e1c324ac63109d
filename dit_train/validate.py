"""Checks that run before any worker starts; each error says what to change."""
from __future__ import annotations

from dit_train.config import Config
from dit_train.loss.reductions import REDUCTIONS
from dit_train.parallel.mesh import ParallelDims


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the keys to change."""


def _check(ok: bool, message: str, errors: list[str]) -> None:
    if not ok:
        errors.append(message)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem found. `world_size`: processes already started
    by an outside launcher (torchrun / SLURM), or None when we start them ourselves."""
    e: list[str] = []
    p, m, t, o = cfg.parallel, cfg.model, cfg.train, cfg.optim
    _check(cfg.mode in ("video", "llm"), f"mode={cfg.mode!r} must be video or llm", e)
    for key in ("dp_replicate", "dp_shard", "cp_ulysses", "cp_ring"):
        _check(getattr(p, key) >= 1, f"parallel.{key}={getattr(p, key)} must be >= 1", e)
    dims = ParallelDims.from_config(p)
    if world_size is not None and world_size != dims.world:
        e.append(f"the launcher started {world_size} processes but {dims.describe()}; make the product of "
                 f"parallel.dp_replicate/dp_shard/cp_ulysses/cp_ring equal {world_size} (e.g. parallel.dp_shard={world_size})")
    _check(p.dp_mode in ("fsdp2", "ddp", "none"), f"parallel.dp_mode={p.dp_mode!r} must be fsdp2, ddp or none", e)
    _check(p.cp_fsdp_mode in ("all", "none"), f"parallel.cp_fsdp_mode={p.cp_fsdp_mode!r} must be all or none", e)
    _check(p.fsdp_prefetch >= 0, f"parallel.fsdp_prefetch={p.fsdp_prefetch} must be >= 0 (0 = FSDP2's implicit prefetch)", e)
    _check(p.device in ("auto", "cpu", "cuda"), f"parallel.device={p.device!r} must be auto, cpu or cuda", e)
    _check(m.dim % m.heads == 0, f"model.dim={m.dim} must be divisible by model.heads={m.heads}", e)
    _check(p.cp_ulysses >= 1 and m.heads % max(1, p.cp_ulysses) == 0,
           f"model.heads={m.heads} must be divisible by parallel.cp_ulysses={p.cp_ulysses} (Ulysses splits heads)", e)
    _check(not (p.dp_mode == "ddp" and p.meta_init),
           "parallel.meta_init=true needs FSDP2 (DDP needs full weights on every rank); set parallel.dp_mode=fsdp2 "
           "or parallel.meta_init=false", e)
    _check(not (p.dp_mode == "none" and p.meta_init), "parallel.meta_init=true needs parallel.dp_mode=fsdp2", e)
    _check(cfg.loss.reduction in REDUCTIONS, f"loss.reduction={cfg.loss.reduction!r} must be one of {REDUCTIONS}", e)
    _check(t.steps >= 0, f"train.steps={t.steps} must be >= 0", e)
    _check(t.global_batch >= 1, f"train.global_batch={t.global_batch} must be >= 1", e)
    _check(t.grad_accum >= 1, f"train.grad_accum={t.grad_accum} must be >= 1", e)
    _check(t.micro_batch_tokens >= 1, f"train.micro_batch_tokens={t.micro_batch_tokens} must be >= 1", e)
    _check(t.precision in ("fp32", "bf16", "fp16"), f"train.precision={t.precision!r} must be fp32, bf16 or fp16", e)
    _check(t.ckpt_every >= 0, f"train.ckpt_every={t.ckpt_every} must be >= 0 (0 = no checkpoints)", e)
    _check(t.keep_last >= 1, f"train.keep_last={t.keep_last} must be >= 1", e)
    _check(t.max_skipped_steps >= 0, f"train.max_skipped_steps={t.max_skipped_steps} must be >= 0", e)
    _check(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0", e)
    _check(t.sample_every >= 0, f"train.sample_every={t.sample_every} must be >= 0 (0 = no validation videos)", e)
    _check(not (t.sample_every > 0 and cfg.mode != "video"),
           "train.sample_every makes validation videos (mode=video); for mode=llm use tools/generate.py", e)
    _check(t.sample_steps >= 1 and t.num_samples >= 1,
           f"train.sample_steps={t.sample_steps} and train.num_samples={t.num_samples} must be >= 1", e)
    _check(t.guidance_scale >= 1.0, f"train.guidance_scale={t.guidance_scale} must be >= 1 (1 = no guidance)", e)
    _check(m.text_dim >= 0 and m.text_len >= 1, f"model.text_dim={m.text_dim} must be >= 0 and model.text_len="
           f"{m.text_len} >= 1", e)
    _check(0.0 <= cfg.data.caption_dropout < 1.0, f"data.caption_dropout={cfg.data.caption_dropout} must be in [0, 1)", e)
    _check(0.0 <= cfg.data.heldout_fraction < 1.0, f"data.heldout_fraction={cfg.data.heldout_fraction} must be in [0, 1)", e)
    _check(cfg.launcher.max_restarts >= 0, f"launcher.max_restarts={cfg.launcher.max_restarts} must be >= 0", e)
    _check(not (cfg.launcher.max_restarts > 0 and t.ckpt_every == 0),
           "launcher.max_restarts > 0 restarts from the latest checkpoint, but train.ckpt_every=0 writes none; "
           "set train.ckpt_every (e.g. 100)", e)
    _check(o.name in ("adamw", "sgd"), f"optim.name={o.name!r} must be adamw or sgd", e)
    _check(o.lr > 0, f"optim.lr={o.lr} must be > 0", e)
    _check(o.max_grad_norm >= 0, f"optim.max_grad_norm={o.max_grad_norm} must be >= 0 (0 disables clipping)", e)
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"optim.betas={list(o.betas)} must be two values in [0, 1)", e)
    if cfg.mode == "video":
        _check(m.name in ("dit", "wan"),
               f"mode=video trains model.name=dit or wan, got {m.name!r} (pick a model=dit_* or model=wan_* config)", e)
        _check(len(m.patch_size) == 3 and all(x >= 1 for x in m.patch_size),
               f"model.patch_size={list(m.patch_size)} must be three positive ints [t, h, w]", e)
    else:
        _check(m.name == "lm", f"mode=llm trains model.name=lm, got {m.name!r} (pick a model=lm_* config)", e)
    if e:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(e))

