"""The caller's video data for the reward losses, and the tasks that pack it.

- `VideoDatum` (datums.py) with a per-clip `advantages` (DiffusionNFT) or `ref_loss`
  (Diffusion-DPO): the clip is noised like a dataset clip ((train.seed, noise key, step)), and
  `RLVideoTask` hands the loss the model's velocity, the target and the clip's scalars per token.
- `VideoTransition`: one step x_k → x_{k+1} of an SDE rollout (Flow-GRPO). `TransitionTask`
  packs x_k at noise level σ_k (the model's input, as sampled), x_{k+1}, and the step's
  constants per token, so the loss can evaluate the transition's log-probability under the
  current weights on whatever rank holds each token.

Per-clip scalars become per-token fields ([L], the clip's value on each of its tokens), so the
CP split hands every rank the values of its own tokens, like Datum's per-token fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dit_train.batch import PackedBatch, video_forward
from dit_train.objectives.flow_matching import per_token_mse, velocity_from_output
from dit_train.posttrain.datums import DatumVideoTask, _Clip, _fail, check_video_datum
from dit_train.posttrain.losses import TokenInputs
from dit_train.posttrain.rollouts import VideoRollout
from dit_train.tasks.captions import pad_contexts
from dit_train.tasks.video import VideoTask, pack_clips, patchify

CLIP_FIELDS = ("advantages", "ref_loss")  # per-clip floats a VideoDatum may carry


@dataclass
class VideoTransition:
    """One transition x_k → x_{k+1} of an SDE rollout (`session.sample_videos(..., sde=True)`).

    latents / next_latents: [C, F, H, W] x_k and x_{k+1}; sigma, sigma_next: their noise levels;
    s: the SDE's s_k and std: the transition's std (rollouts.py); caption: the clip's caption;
    old_logprob: the transition's log-probability under the sampling weights (mean per element);
    advantages: the clip's advantage; ref_mean: [C, F, H, W] the reference model's mean μ_ref of
    this transition (`session.transition_means`), needed by the KL term only; run: the id of the
    run that sampled it (a rollout of another run is refused).
    """

    latents: Any
    next_latents: Any
    sigma: float
    sigma_next: float
    s: float
    std: float
    caption: str
    old_logprob: float
    advantages: float
    run: str
    ref_mean: Any = None


def transitions(rollout: VideoRollout, advantage: float, steps: list[int] | None = None) -> list[VideoTransition]:
    """The transitions of an SDE rollout (steps: which ones; default all), each with the clip's
    advantage. Flow-GRPO trains on `flow_grpo_steps(rollout)`: all but the last."""
    if not rollout.log_probs:
        raise ValueError(f"rollout of {rollout.caption!r} has no trajectory: sample it with sde=True")
    chosen = range(len(rollout.log_probs)) if steps is None else steps
    return [VideoTransition(rollout.latents[k], rollout.latents[k + 1], rollout.sigmas[k], rollout.sigmas[k + 1],
                            _s_of(rollout, k), rollout.stds[k], rollout.caption, rollout.log_probs[k], advantage,
                            rollout.run) for k in chosen]


def flow_grpo_steps(rollout: VideoRollout) -> list[int]:
    """The transitions Flow-GRPO trains on: every one but the last (σ_{K−1} → 0), as Flow-GRPO's
    own trainer does (its timestep_fraction 0.99 keeps int(0.99·K) = K − 1 of K steps); all of
    a one-step rollout.

    The last transition starts at the grid's smallest σ (1/1000 on diffusers' grid), so its std
    is tiny (7e-4 at 10 steps) and its noise leaves no trace in any reward: its term of the policy
    gradient, A·∇log p, has expectation ~0 and a size ∝ 1/std. For a model predicting x̂0
    (v = (x − x̂0)/max(σ, x0_min_t)) it is the largest term of all — ∂μ/∂x̂0 = 0.025 over std 7e-4,
    36 per element against 15 at the step before (a velocity model: 1.8 against 1.7): 83% of the
    gradient's variance on the 10-step shapes run, with no measurable signal (docs/video-rl.md,
    "Sanity check"). Without it a 12-step run rewarding brightness ended brighter than the same
    seed's run rewarding darkness on 6 of 6 seeds (4 of 6 with it), and on the tiny model the
    gradient's pull on the output offset had the right sign in 6 of 6 batches (2 of 6 with it,
    for x̂0)."""
    k = len(rollout.log_probs)
    if not k:
        raise ValueError(f"rollout of {rollout.caption!r} has no trajectory: sample it with sde=True")
    return list(range(k - 1 if k > 1 else k))


def _s_of(rollout: VideoRollout, k: int) -> float:
    """s_k from the recorded std: std = s_k·sqrt(σ_k − σ_{k+1})."""
    return rollout.stds[k] / math.sqrt(rollout.sigmas[k] - rollout.sigmas[k + 1])


def _scalar(i: int, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        raise _fail(i, name, f"is a {type(value).__name__}; expected one float per clip")
    v = float(value)
    if not math.isfinite(v):
        raise _fail(i, name, f"is {v}: expected a finite float")
    return v


def check_clip_fields(batch: list[Any], required: tuple[str, ...]) -> list[dict[str, float]]:
    """Each VideoDatum's per-clip floats ({name: value}); the loss's `required` ones must be on
    every datum (ValueError naming the datum)."""
    out = []
    for i, d in enumerate(batch):
        values = {}
        for name in CLIP_FIELDS:
            value = getattr(d, name, None)
            if value is not None:
                values[name] = _scalar(i, name, value)
            elif name in required:
                raise _fail(i, name, f"is required by this loss (one float per clip)")
        out.append(values)
    for name in CLIP_FIELDS:  # a field on some clips only would silently change what the loss means
        has = [name in v for v in out]
        if any(has) and not all(has):
            raise _fail(has.index(False), name, f"is missing but datum {has.index(True)} has it: give every datum "
                                                f"of a call the same fields")
    return out


class RLVideoTask(DatumVideoTask):
    """DatumVideoTask whose packs also carry the clips' scalars per token, and which hands the
    loss the model's velocity and the target (`token_inputs`). Captions are never dropped: the
    reward losses train the caption-conditioned policy."""

    def __init__(self, clips: dict[int, _Clip], scalars: dict[int, dict[str, float]], model_cfg: Any, loss_cfg: Any,
                 seed: int, old_velocity: dict[int, torch.Tensor] | None = None):
        super().__init__(clips, model_cfg, loss_cfg, seed, 0.0)
        self.scalars = scalars
        self.old_velocity = old_velocity  # {key: [C, F, H, W]} or None (every clip has one, or none)

    def build(self, sample_ids: list[int], step: int) -> PackedBatch:
        batch = super().build(sample_ids, step)
        seg = batch.seg.clamp(min=0)
        kept = batch.sample_ids.tolist()
        carried = next(iter(self.scalars.values()), {})  # every clip of a call carries the same fields
        for name in CLIP_FIELDS:
            if name in carried:  # also on an empty pack (a rank with less work): the loss reads it
                values = torch.tensor([self.scalars[sid][name] for sid in kept] + [0.0])
                batch.tokens[name] = values[seg] if seg.numel() else torch.zeros(0)
        if self.old_velocity is not None:  # token i is token `order[i]` of its clip, as patchify lays it out
            per_clip = [patchify(self.old_velocity[sid], self.patch)[0] for sid in kept]
            starts = torch.tensor([0] + [p.shape[0] for p in per_clip], dtype=torch.long).cumsum(0)
            flat = torch.cat([*per_clip, torch.zeros(1, self.patch_dim)])  # the last row: padding tokens'
            rows = torch.where(batch.seg >= 0, starts[seg] + batch.order, torch.full_like(seg, len(flat) - 1))
            batch.tokens["old_velocity"] = flat[rows]
        return batch

    def token_inputs(self, model: torch.nn.Module, batch: PackedBatch, attn_meta: Any) -> TokenInputs:
        """nll = the per-token flow-matching MSE (times w(t), as in training); fields: velocity
        [L, D] (grad flows), target [L, D], the clips' scalars [L] and old_velocity [L, D] when
        the datums carry it."""
        t = batch.samples["t"]
        out = video_forward(model, batch, attn_meta).float()
        t_tok = torch.cat([t.float(), t.new_ones(1, dtype=torch.float32)]).to(batch.seg.device)[batch.seg]
        v = velocity_from_output(out, batch.tokens["x"], t_tok, self.prediction, self.x0_min_t)
        mse = per_token_mse(v, batch.tokens["target"])
        fields = {"velocity": v, "target": batch.tokens["target"].float()}
        fields |= {name: batch.tokens[name] for name in (*CLIP_FIELDS, "old_velocity") if name in batch.tokens}
        return TokenInputs(mse, batch.valid, fields)


def rl_video_task(batch: list[Any], offset: int, model_cfg: Any, loss_cfg: Any, seed: int, max_tokens: int,
                  required: tuple[str, ...]) -> tuple[RLVideoTask, list[int]]:
    """(task, sample ids in the caller's order) of a reward loss's VideoDatums."""
    patch = tuple(model_cfg.patch_size)
    scalars = check_clip_fields(batch, required)
    clips: dict[int, _Clip] = {}
    by_key: dict[int, dict[str, float]] = {}
    olds: dict[int, torch.Tensor] = {}
    keys = []
    has_old = [getattr(d, "old_velocity", None) is not None for d in batch]
    if any(has_old) and not all(has_old):
        raise _fail(has_old.index(False), "old_velocity", f"is missing but datum {has_old.index(True)} has it: give "
                                                          f"every datum of a call the same fields")
    for i, d in enumerate(batch):
        x, emb = check_video_datum(i, d, model_cfg.in_channels, patch, model_cfg.text_dim, max_tokens)
        key = offset + i if d.noise_key is None else int(d.noise_key)
        if key in clips:
            raise _fail(i, "noise_key", f"{key} is used twice in this call (noise keys must differ)")
        clips[key], by_key[key] = _Clip(x, d.caption, emb), scalars[i]
        if has_old[i]:
            olds[key] = _old_velocity(i, d.old_velocity, x)
        keys.append(key)
    return RLVideoTask(clips, by_key, model_cfg, loss_cfg, seed, olds if olds else None), keys


def _old_velocity(i: int, value: Any, x: torch.Tensor) -> torch.Tensor:
    """A datum's old_velocity as float32 [C, F, H, W] of its clip's shape (ValueError naming it)."""
    v = torch.as_tensor(value).detach().to(torch.float32).cpu()
    if v.shape != x.shape:
        raise _fail(i, "old_velocity", f"has shape {list(v.shape)}; expected the clip's {list(x.shape)}")
    if not torch.isfinite(v).all():
        raise _fail(i, "old_velocity", "is not finite")
    return v


# -- transitions (Flow-GRPO) ---------------------------------------------------------------------------


TRANSITION_SCALARS = ("sigma_next", "s", "std", "advantages", "old_logprob")


class TransitionTask(VideoTask):
    """Packs of SDE transitions: tokens["x"] = x_k (the model's input at t = σ_k, as sampled),
    tokens["next"] = x_{k+1}, tokens["ref_mean"] when given, and the step's scalars per token.
    Sample id = offset + the transition's position in the step's stream (no noise is drawn)."""

    def __init__(self, items: dict[int, VideoTransition], model_cfg: Any, loss_cfg: Any, seed: int):
        super().__init__(items, model_cfg, loss_cfg, seed, 0.0)
        self.has_ref = any(tr.ref_mean is not None for tr in items.values())  # also on a rank's empty pack

    def sample_lengths(self) -> dict[int, int]:
        return {k: math.prod(s // p for s, p in zip(tr.latents.shape[1:], self.patch)) for k, tr in self.dataset.items()}

    def lengths(self) -> list[int]:
        return list(self.sample_lengths().values())

    def build(self, sample_ids: list[int], step: int) -> PackedBatch:
        items = [self.dataset[sid] for sid in sample_ids]
        fields = {"x": [tr.latents for tr in items], "next": [tr.next_latents for tr in items]}
        if self.has_ref:
            fields["ref_mean"] = [tr.ref_mean for tr in items]
        samples = {"t": torch.tensor([tr.sigma for tr in items], dtype=torch.float32)}
        if self.text_dim:
            samples["context"], samples["context_len"] = pad_contexts(
                [self.caption_embedding(tr) for tr in items], self.text_dim)
        batch = pack_clips(fields, self.patch, self.patch_dim, samples, torch.tensor(sample_ids, dtype=torch.long))
        seg = batch.seg.clamp(min=0)
        for name in TRANSITION_SCALARS:
            values = torch.tensor([float(getattr(tr, name)) for tr in items] + [0.0], dtype=torch.float64)
            batch.tokens[name] = values[seg] if seg.numel() else torch.zeros(0, dtype=torch.float64)
        return batch

    def token_inputs(self, model: torch.nn.Module, batch: PackedBatch, attn_meta: Any) -> TokenInputs:
        """fields: velocity [L, D] (grad flows), x, next (and ref_mean) [L, D], sigma and the
        step's scalars [L]; nll is unused by the transition losses (zeros)."""
        t = batch.samples["t"]
        out = video_forward(model, batch, attn_meta).float()
        t_tok = torch.cat([t.float(), t.new_ones(1, dtype=torch.float32)]).to(batch.seg.device)[batch.seg]
        v = velocity_from_output(out, batch.tokens["x"], t_tok, self.prediction, self.x0_min_t)
        fields = {"velocity": v, "sigma": t_tok.double()}
        fields |= {name: batch.tokens[name] for name in ("x", "next", "ref_mean", *TRANSITION_SCALARS)
                   if name in batch.tokens}
        # padding tokens (seg -1: CP's and empty packs') carry std 0: give them 1, so that their
        # log-probability is finite and their zero weight cannot meet a NaN in the backward
        fields["std"] = torch.where(batch.seg >= 0, fields["std"], torch.ones_like(fields["std"]))
        return TokenInputs(torch.zeros_like(t_tok), batch.valid, fields)


def check_transition(i: int, tr: Any, model_cfg: Any, max_tokens: int, run: str, needs_ref: bool) -> VideoTransition:
    """A checked copy of transition `i` (ValueError / TypeError naming the datum and field)."""
    if not isinstance(tr, VideoTransition):
        raise TypeError(f"datum {i} is a {type(tr).__name__}; flow_grpo_loss takes VideoTransition(...)s "
                        f"(dit_train.posttrain.transitions(rollout, advantage))")
    if tr.run != run:
        raise _fail(i, "run", f"is {tr.run!r}: this rollout was sampled by another run (this session: {run!r}); "
                              f"sample the rollouts with this session's sample_videos")
    patch = tuple(model_cfg.patch_size)
    out = {}
    for name in ("latents", "next_latents", "ref_mean"):
        value = getattr(tr, name)
        if value is None:
            if name != "ref_mean" or needs_ref:
                raise _fail(i, name, "is required" + (" by the KL term (kl_coef > 0)" if name == "ref_mean" else ""))
            continue
        x = torch.as_tensor(value).detach().to(torch.float32).cpu()
        if x.dim() != 4 or x.shape[0] != model_cfg.in_channels or any(n % p for n, p in zip(x.shape[1:], patch)):
            raise _fail(i, name, f"has shape {list(x.shape)}; expected [C={model_cfg.in_channels}, F, H, W] with F, H, W "
                                 f"multiples of model.patch_size={list(patch)}")
        if not torch.isfinite(x).all():
            raise _fail(i, name, "is not finite")
        out[name] = x
    if out["next_latents"].shape != out["latents"].shape or ("ref_mean" in out and out["ref_mean"].shape != out["latents"].shape):
        raise _fail(i, "next_latents", f"has shape {list(out['next_latents'].shape)}; expected the shape of latents "
                                       f"{list(out['latents'].shape)}")
    if math.prod(s // p for s, p in zip(out["latents"].shape[1:], patch)) > max_tokens:
        raise _fail(i, "latents", f"makes more tokens than train.micro_batch_tokens={max_tokens}")
    for name in ("sigma", "sigma_next", "s", "std", "old_logprob", "advantages"):
        _scalar(i, name, getattr(tr, name))
    if not 0 <= tr.sigma_next < tr.sigma <= 1 or tr.std <= 0:
        raise _fail(i, "sigma", f"{tr.sigma} -> {tr.sigma_next} (std {tr.std}): expected 1 >= sigma > sigma_next >= 0 "
                                f"and std > 0")
    if not isinstance(tr.caption, str):
        raise _fail(i, "caption", f"is a {type(tr.caption).__name__}; expected a string")
    return VideoTransition(out["latents"], out["next_latents"], float(tr.sigma), float(tr.sigma_next), float(tr.s),
                           float(tr.std), tr.caption, float(tr.old_logprob), float(tr.advantages), tr.run,
                           out.get("ref_mean"))
