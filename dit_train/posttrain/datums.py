"""The caller's data: `Datum` (causal LM) and `VideoDatum` (video diffusion), their checks, and
the in-memory tasks that pack them exactly like the configured data's samples.

A call's datums become the samples of a small task (`DatumLMTask`, `DatumVideoTask`) whose
sample ids are the datums' positions in the step's stream of datums (`offset + i`), so the
session spreads, packs and CP-splits them with the trainer's own pieces. Every rank receives
the same full list; each builds only the packs of its DP rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dit_train.data_pipelines.text import IGNORE
from dit_train.batch import PackedBatch
from dit_train.tasks.llm import LMTask
from dit_train.tasks.video import VideoTask

# per-token float fields of a Datum, aligned with its tokens ([0] is never used)
TOKEN_FIELDS = ("weights", "advantages", "ref_logprobs", "old_logprobs")


@dataclass
class Datum:
    """One sequence of a causal-LM call (mode=llm).

    tokens: [T] integer token ids, T >= 2 (prompt and completion together).
    weights: [T] float aligned with tokens: weights[t] weighs the loss of predicting tokens[t]
        from tokens[:t]; 0 = no gradient (the loss mask: prompt tokens). weights[0] must be 0
        (nothing predicts the first token). None = 0 for tokens[0], 1 for every other token.
    advantages: [T] float aligned like weights, or one float for the whole sequence (GRPO/PPO).
    ref_logprobs: [T] float, the reference model's log-probs of the tokens (KL penalty, DPO).
    old_logprobs: [T] float, the sampling policy's log-probs (PPO/GRPO importance ratio).
    Log-probs use the layout of `TrainingSession.forward`: [t] is log p(tokens[t] | tokens[:t]),
    [0] is ignored. Lists and tensors are both accepted.
    """

    tokens: Any
    weights: Any = None
    advantages: Any = None
    ref_logprobs: Any = None
    old_logprobs: Any = None


@dataclass
class VideoDatum:
    """One clip of a video call (mode=video).

    pixels: [C, F, H, W] float in [-1, 1] (C = model.in_channels), or
    latents: [C, F, H, W] VAE latents instead (latent-cache runs; same normalization as the cache).
    F, H, W must be multiples of model.patch_size.
    caption: the clip's caption (embedded like the configured data's: bytes, unless text_emb);
    text_emb: [Lt, model.text_dim] cached text-encoder output, for runs trained on one.
    noise_key: keys the clip's noise, timestep and caption dropout (with train.seed and the
        step). None = the clip's position in this step's stream of datums, so splitting a batch
        into several calls changes nothing.
    advantages: one float, the clip's advantage (diffusion_nft_loss).
    ref_loss: one float, the reference model's token-mean flow-matching error on this clip with
        the same noise (diffusion_dpo_loss; `TrainingSession.clip_losses` of the reference).
    old_velocity: [C, F, H, W] the old policy's velocity on this clip's noisy input at this step
        (diffusion_nft_loss's v_old; `TrainingSession.clip_velocities`); None = the current
        weights' own, detached (on-policy, no proximal term).
    """

    pixels: Any = None
    latents: Any = None
    caption: str = ""
    text_emb: Any = None
    noise_key: int | None = None
    advantages: float | None = None
    ref_loss: float | None = None
    old_velocity: Any = None


def _fail(i: int, field: str, why: str) -> ValueError:
    return ValueError(f"datum {i}: {field} {why}")


def _float_vector(i: int, name: str, value: Any, T: int, scalar_ok: bool = False) -> torch.Tensor:
    """[T] float32 of a per-token field (a number broadcasts when scalar_ok)."""
    if scalar_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = torch.full((T,), float(value))
    t = torch.as_tensor(value)
    if scalar_ok and t.dim() == 0:
        t = t.expand(T)
    if t.dtype == torch.bool or t.is_complex():
        raise _fail(i, name, f"has dtype {t.dtype}; expected a real float tensor")
    if t.shape != (T,):
        hint = " or one float" if scalar_ok else ""
        raise _fail(i, name, f"has shape {list(t.shape)}; expected [{T}] (one value per token{hint})")
    t = t.detach().to(torch.float32).cpu()
    bad = ~torch.isfinite(t[1:])
    if bad.any():
        raise _fail(i, name, f"is not finite at token {int(bad.nonzero()[0]) + 1}")
    return t


def check_prompts(prompts: Any, vocab_size: int) -> None:
    """`session.generate`'s prompts: a list of non-empty lists of token ids in [0, vocab_size).
    Raises ValueError naming the prompt (an id outside the vocabulary would fail deep in the
    embedding, on rank 0 only)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token id lists (e.g. [[72, 105]])")
    for i, p in enumerate(prompts):
        t = torch.as_tensor(p) if not isinstance(p, (str, bytes)) else None
        if t is None or t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.60}")
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"prompt {i} has dtype {t.dtype}; expected integer token ids")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {i} holds id {lo if lo < 0 else hi}, outside [0, model.vocab_size={vocab_size})")


def check_datum(i: int, d: Any, vocab_size: int, max_tokens: int) -> Datum:
    """A checked copy of the caller's datum `i`: tensors on the CPU, weights filled in.
    Raises ValueError naming the datum and the field."""
    if not isinstance(d, Datum):
        raise TypeError(f"datum {i} is a {type(d).__name__}; pass dit_train.posttrain.Datum(tokens=..., ...) "
                        f"(mode=llm) or a list of dataset sample ids")
    tokens = torch.as_tensor(d.tokens)
    if tokens.numel() == 0:  # checked first: an empty list becomes a float tensor
        raise _fail(i, "tokens", "is empty; expected [T] integer token ids with T >= 2 (one is predicted from the rest)")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise _fail(i, "tokens", f"has dtype {tokens.dtype}; expected integer token ids")
    if tokens.dim() != 1 or tokens.numel() < 2:
        raise _fail(i, "tokens", f"has shape {list(tokens.shape)}; expected [T] with T >= 2 "
                                 f"(one is predicted from the rest)")
    tokens = tokens.to(torch.int64).cpu()
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise _fail(i, "tokens", f"holds id {lo if lo < 0 else hi}, outside [0, model.vocab_size={vocab_size})")
    T = tokens.numel()
    if T - 1 > max_tokens:
        raise _fail(i, "tokens", f"has {T - 1} predicted positions, more than train.micro_batch_tokens={max_tokens}; "
                                 f"raise train.micro_batch_tokens or shorten the sequence")
    if d.weights is None:
        weights = torch.ones(T)
        weights[0] = 0.0
    else:
        weights = _float_vector(i, "weights", d.weights, T)
        if weights[0] != 0:
            raise _fail(i, "weights", f"[0] is {float(weights[0])}: it must be 0 (nothing predicts the first token; "
                                      f"weights[t] weighs the prediction of tokens[t])")
    out = Datum(tokens=tokens, weights=weights)
    if d.advantages is not None:
        out.advantages = _float_vector(i, "advantages", d.advantages, T, scalar_ok=True)
    for name in ("ref_logprobs", "old_logprobs"):
        value = getattr(d, name)
        if value is None:
            continue
        lp = _float_vector(i, name, value, T)
        if lp[1:].max() > 1e-4:
            raise _fail(i, name, f"holds {float(lp[1:].max()):.3g} > 0: expected log-probabilities (<= 0), "
                                 f"as TrainingSession.forward returns them")
        setattr(out, name, lp)
    return out


def check_datums(batch: list[Any], vocab_size: int, max_tokens: int) -> list[Datum]:
    """Checked copies of a call's datums; every datum must carry the same optional fields (a
    field that only some sequences have would silently change what the loss means)."""
    out = [check_datum(i, d, vocab_size, max_tokens) for i, d in enumerate(batch)]
    for name in TOKEN_FIELDS[1:]:
        has = [getattr(d, name) is not None for d in out]
        if any(has) and not all(has):
            i, j = has.index(True), has.index(False)
            raise _fail(j, name, f"is missing but datum {i} has it: give every datum of a call the same fields")
    return out


def check_video_datum(i: int, d: Any, in_channels: int, patch: tuple[int, int, int], text_dim: int,
                      max_tokens: int) -> tuple[torch.Tensor, Any]:
    """(clip [C, F, H, W] float32, text embedding or None) of the caller's video datum `i`."""
    if not isinstance(d, VideoDatum):
        raise TypeError(f"datum {i} is a {type(d).__name__}; pass dit_train.posttrain.VideoDatum(pixels=..., "
                        f"caption=...) (mode=video) or a list of dataset sample ids")
    if (d.pixels is None) == (d.latents is None):
        raise _fail(i, "pixels/latents", "must be given, exactly one of them")
    name = "pixels" if d.pixels is not None else "latents"
    x = torch.as_tensor(getattr(d, name))
    if not x.dtype.is_floating_point:
        raise _fail(i, name, f"has dtype {x.dtype}; expected float (pixels in [-1, 1])")
    if x.dim() != 4 or x.shape[0] != in_channels:
        raise _fail(i, name, f"has shape {list(x.shape)}; expected [C={in_channels}, F, H, W]")
    if any(n < p or n % p for n, p in zip(x.shape[1:], patch)):
        raise _fail(i, name, f"has shape {list(x.shape)}: frames, height and width must be multiples of "
                             f"model.patch_size={list(patch)}")
    x = x.detach().to(torch.float32).cpu()
    if not torch.isfinite(x).all():
        raise _fail(i, name, "is not finite")
    if name == "pixels" and (x.min() < -1.001 or x.max() > 1.001):
        raise _fail(i, name, f"spans [{float(x.min()):.3g}, {float(x.max()):.3g}]; expected [-1, 1] "
                             f"(from uint8: x / 127.5 - 1)")
    n = math.prod(s // p for s, p in zip(x.shape[1:], patch))
    if n > max_tokens:
        raise _fail(i, name, f"makes {n} tokens, more than train.micro_batch_tokens={max_tokens}")
    if not isinstance(d.caption, str):
        raise _fail(i, "caption", f"is a {type(d.caption).__name__}; expected a string")
    emb = None
    if d.text_emb is not None:
        emb = torch.as_tensor(d.text_emb).detach().to(torch.float32).cpu()
        if emb.dim() != 2 or emb.shape[1] != text_dim:
            raise _fail(i, "text_emb", f"has shape {list(emb.shape)}; expected [Lt, model.text_dim={text_dim}]")
    return x, emb


@dataclass
class _Call:
    """One call's data as the trainer's pieces see it."""

    task: Any
    keys: list[int]  # sample id of each item, in the caller's order
    lengths: dict[int, int]  # tokens per sample id
    offset: int = 0  # sample id of the first datum (datum i has id offset + i)
    datums: list[Datum] | None = None  # checked LM datums (None: dataset ids or video)
    seq_inputs: dict[str, torch.Tensor] | None = None  # [S] per-sequence inputs of sequence_terms (video)


# -- the in-memory tasks --------------------------------------------------------------------------


class DatumLMTask(LMTask):
    """A causal-LM task over one call's datums (sample id = offset + position in the call).

    Packs carry, besides ids and labels, each predicted position's weight (valid = weight != 0)
    and the call's optional per-token fields, all [L] float32 aligned with the labels, so the CP
    split hands every rank the values of its own tokens.
    all_valid: every predicted position is valid, whatever its weight (forward-only calls).
    """

    def __init__(self, datums: list[Datum], offset: int, all_valid: bool = False):
        super().__init__(dataset=None)
        self.datums, self.offset, self.all_valid = datums, offset, all_valid
        self.fields = [f for f in TOKEN_FIELDS if datums and getattr(datums[0], f) is not None]

    def lengths(self) -> list[int]:
        return [d.tokens.numel() - 1 for d in self.datums]

    def sample_lengths(self) -> dict[int, int]:
        """{sample id: predicted positions} of the call's datums."""
        return {self.offset + i: n for i, n in enumerate(self.lengths())}

    def build(self, sample_ids: list[int], step: int) -> PackedBatch:
        z = torch.zeros(0, dtype=torch.long)
        ids, labels, pos, seg, fields = [z], [z], [z], [z], {f: [torch.zeros(0)] for f in self.fields}
        for k, sid in enumerate(sample_ids):
            d = self.datums[sid - self.offset]
            n = d.tokens.numel() - 1
            ids.append(d.tokens[:-1])
            labels.append(d.tokens[1:])
            pos.append(torch.arange(n))
            seg.append(torch.full((n,), k, dtype=torch.long))
            for f in self.fields:
                fields[f].append(getattr(d, f)[1:])
        p, w = torch.cat(pos), torch.cat(fields["weights"])
        valid = torch.ones_like(w, dtype=torch.bool) if self.all_valid else w != 0
        y = torch.cat(labels)
        tokens = {"ids": torch.cat(ids), "labels": torch.where(valid, y, torch.full_like(y, IGNORE))}
        tokens.update({f: torch.cat(v) for f, v in fields.items()})
        return PackedBatch(seg=torch.cat(seg), pos=p[:, None], order=p, valid=valid, tokens=tokens,
                           sample_ids=torch.tensor(sample_ids, dtype=torch.long), causal=True)


@dataclass
class _Clip:
    pixels: torch.Tensor
    caption: str
    text_emb: torch.Tensor | None


class DatumVideoTask(VideoTask):
    """The video task over one call's clips: sample id = the clip's noise key (noise, timestep
    and caption dropout are drawn from (train.seed, key, step) like a dataset clip's)."""

    def __init__(self, clips: dict[int, _Clip], model_cfg: Any, loss_cfg: Any, seed: int, caption_dropout: float):
        super().__init__(clips, model_cfg, loss_cfg, seed, caption_dropout)

    def sample_lengths(self) -> dict[int, int]:
        return {k: math.prod(s // p for s, p in zip(c.pixels.shape[1:], self.patch)) for k, c in self.dataset.items()}

    def lengths(self) -> list[int]:
        return list(self.sample_lengths().values())


def video_task(batch: list[Any], offset: int, model_cfg: Any, loss_cfg: Any, seed: int, caption_dropout: float,
               max_tokens: int) -> tuple[DatumVideoTask, list[int]]:
    """(task, sample ids in the caller's order) of a call's VideoDatums."""
    patch = tuple(model_cfg.patch_size)
    clips: dict[int, _Clip] = {}
    keys = []
    for i, d in enumerate(batch):
        x, emb = check_video_datum(i, d, model_cfg.in_channels, patch, model_cfg.text_dim, max_tokens)
        key = offset + i if d.noise_key is None else int(d.noise_key)
        if key in clips:
            raise _fail(i, "noise_key", f"{key} is used twice in this call (noise keys must differ)")
        clips[key] = _Clip(x, d.caption, emb)
        keys.append(key)
    return DatumVideoTask(clips, model_cfg, loss_cfg, seed, caption_dropout), keys
