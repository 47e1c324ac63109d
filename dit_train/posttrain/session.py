"""TrainingSession: the caller drives training call by call (deferred normalization).

    session = TrainingSession.from_overrides(["mode=llm", "parallel.dp_shard=2"])
    session.forward_backward(batch_a, grpo_loss())       # back-propagates raw sums, adds counts
    session.forward_backward(batch_b, grpo_loss())       # ... as many calls as you like
    session.optim_step(normalization="num_loss_tokens")  # grads *= 1/N, clip, step, zero

A batch is the caller's data (`Datum`s for mode=llm, `VideoDatum`s for mode=video) or sample
ids of the configured dataset. Every rank calls the same methods with the same full batch;
the session spreads it over the DP ranks, packs it by train.micro_batch_tokens and splits the
packs over the CP ranks with the trainer's own pieces (engine/trainer.py).

Each call back-propagates Σ a_t·l_t (losses.py) and adds the call's global counts (tokens with
non-zero weight; sequences with at least one — pairs for DPO) to an accumulator: one small
metadata sync per call (plus a fingerprint check that every rank passed the same batch, and
the statistics sync of sequence-level losses). `optim_step` scales every gradient in place by
1/count — `grad.mul_`, which keeps FSDP2's DTensor gradients sharded — then clips, steps and
resets. Gradients are reduced once per optim_step: calls accumulate unreduced gradients and the
step flushes them with one reduction (FSDP2 and DDP alike).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dit_train.checkpoint import (
    export_weights,
    find_checkpoint,
    full_state_dict,
    load_checkpoint,
    save_checkpoint,
    save_safetensors,
)
from dit_train.compose import compose, load_config
from dit_train.config import Config, to_yaml
from dit_train.config.errors import ConfigError
from dit_train.data_pipelines import prepare_data
from dit_train.engine.build import build_run
from dit_train.engine.checks import check_config
from dit_train.engine.launch import external_world_size
from dit_train.generate import generate_batch
from dit_train.loss import inverse_sample_tokens, sync_sequence_sums
from dit_train.models import build_model
from dit_train.parallel.mesh import ParallelContext
from dit_train.posttrain.datums import (TOKEN_FIELDS, Datum, DatumLMTask, VideoDatum, _Call, check_datums,
                                        check_prompts, video_task)
from dit_train.posttrain.losses import LossFn, TokenInputs, sft_loss
from dit_train.posttrain.video_session import VideoSessionMixin

NORMALIZATIONS = ("num_loss_tokens", "num_sequences", "none")


class DoubleNormalizationError(ValueError):
    """A pre-normalized loss (raw_sum=False) met a normalizing optim_step."""


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """`cfg` with dotted overrides ("parallel.dp_shard=2"), checked against the schema."""
    if not overrides:
        return cfg

    node = OmegaConf.structured(cfg)
    node.merge_with_dotlist(list(overrides))
    return OmegaConf.to_object(node)


class TrainingSession(VideoSessionMixin):
    """A model, its optimizer and a parallel layout, driven call by call (see the module doc).

    cfg: a typed Config (`dit_train.compose.compose`, or `from_overrides`). The process group is
    created from the launcher's variables when the layout needs several processes: run the
    session inside `dit_train.engine.launch.launch(cfg, fn)` or under torchrun.
    task: the configured data's task instead of the one cfg.data builds (dataset-id calls).
    ctx: an existing parallel context of cfg.parallel's layout (several sessions of one layout
    in one process group share it; default: created, with the process group if needed).
    """

    def __init__(self, cfg: Config, task: Any | None = None, ctx: ParallelContext | None = None):
        check_config(cfg, external_world_size())
        moe = cfg.model.moe
        if moe.num_experts and (moe.aux_loss_coef or moe.z_loss_coef):
            # the session's losses come from the caller; the router terms would silently vanish
            raise ConfigError(f"the post-training session does not add the mixture-of-experts router losses "
                              f"(model.moe.aux_loss_coef={moe.aux_loss_coef}, z_loss_coef={moe.z_loss_coef}): "
                              f"set both to 0 to post-train the experts without them, or train with python -m dit_train")
        if getattr(cfg.model, "causal_block_frames", 0):
            # the session's datums are packed bidirectionally (posttrain/video_data.py): a causal model's
            # losses would be taken under another mask than it samples with
            raise ConfigError(f"the post-training session has no block-causal packs yet (model.causal_block_frames="
                              f"{cfg.model.causal_block_frames}): post-train a bidirectional run (docs/causal.md)")
        run = build_run(cfg, ctx, task=task)
        self.cfg = run.cfg  # train.micro_batch_tokens=0 (auto) resolved by the data
        self.run, self.ctx, self.task, self.model = run, run.ctx, run.task, run.model
        self.optimizer, self.scheduler, self._trainer = run.optimizer, run.scheduler, run.trainer
        self._lengths = dict(enumerate(self.task.lengths()))
        self.step_count = 0
        self._reset()

    @classmethod
    def from_overrides(cls, overrides: list[str] | tuple[str, ...] = ()) -> "TrainingSession":
        """A session from command-line style overrides (no Hydra app needed):
        `TrainingSession.from_overrides(["mode=llm", "model.dim=64", "optim.lr=1e-4"])`."""
        cfg = compose(list(overrides))
        prepare_data(cfg.data, cfg.model)  # idempotent, safe to race (the embedded video set)
        return cls(cfg)

    def _reset(self) -> None:
        self.num_loss_tokens = 0
        self.num_sequences = 0
        self._raw_sums: set[bool] = set()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        self._stats: dict[str, torch.Tensor] = {}  # name -> [Σ value, Σ weight] (this rank's part)
        self._stream = 0  # datums passed since the last optim_step (default noise keys of video datums)
        self._pending_sync = False

    # -- the caller's batch -----------------------------------------------------------------------

    def _make_call(self, batch: Any, loss_fn: LossFn | None, all_valid: bool = False) -> _Call:
        """Check the batch and build the call's task; refuses what the loss cannot use."""
        if not isinstance(batch, (list, tuple)) or not batch:
            raise ValueError("a batch is a non-empty list of datums (Datum / VideoDatum) or of dataset sample ids")
        name = f"{loss_fn.name}_loss" if loss_fn is not None else "forward"
        if all(isinstance(x, int) and not isinstance(x, bool) for x in batch):
            if loss_fn is None or loss_fn.required_fields() or loss_fn.sequence_level:
                raise ValueError(f"{name} needs the caller's data (advantages, log-probs): pass Datum(...)s, "
                                 f"not dataset ids")
            return _Call(self.task, list(batch), self._lengths)
        mode = self.cfg.mode
        if loss_fn is not None and loss_fn.video_inputs:
            if mode != "video":
                raise ValueError(f"{name} trains a video generator: mode=video only (this session is mode={mode})")
            return self._video_call(batch, loss_fn)
        if mode == "video":
            if loss_fn is None or loss_fn.needs_logprobs:
                raise ValueError(f"{name} needs token log-probs: mode=llm only (this session is mode=video)")
            if isinstance(batch[0], Datum):
                raise TypeError("Datum is for mode=llm; this session is mode=video: pass VideoDatum(pixels=..., ...)")
            t, m = self.cfg.train, self.cfg.model
            task, keys = video_task(list(batch), self._stream, m, self.cfg.loss, t.seed, self.cfg.data.caption_dropout,
                                    t.micro_batch_tokens)
            call = _Call(task, keys, task.sample_lengths())
            self._check_same_batch(call, [tuple(c.pixels.shape) for c in task.dataset.values()])
            return call
        if isinstance(batch[0], VideoDatum):
            raise TypeError("VideoDatum is for mode=video; this session is mode=llm: pass Datum(tokens=..., ...)")
        datums = check_datums(list(batch), self.cfg.model.vocab_size, self.cfg.train.micro_batch_tokens)
        if loss_fn is not None:
            loss_fn.check(datums)
        task = DatumLMTask(datums, self._stream, all_valid)
        call = _Call(task, [self._stream + i for i in range(len(datums))], task.sample_lengths(), self._stream, datums)
        self._check_same_batch(call, [t for d in datums for t in (d.tokens, d.weights != 0)])
        return call

    def _check_same_batch(self, call: _Call, content: list[Any]) -> None:
        """Every rank must pass the same full batch (each builds only its own packs): one tiny
        all-reduce (MAX of ±fingerprint over the world group) finds a rank that did not, before
        any collective could hang on mismatched packs. content: tensors or reprs to fingerprint."""
        if self.ctx.world_group is None:
            return
        crc = zlib.crc32(repr(call.keys).encode())
        for part in content:
            crc = zlib.crc32(part.numpy().tobytes() if isinstance(part, torch.Tensor) else repr(part).encode(), crc)
        fp = torch.tensor([crc, -crc], dtype=torch.int64, device=self.ctx.device)
        dist.all_reduce(fp, op=dist.ReduceOp.MAX, group=self.ctx.world_group)
        if int(fp[0]) != -int(fp[1]):
            raise ValueError("the ranks passed different batches: every rank must call forward_backward / forward "
                             "with the same full list (the session spreads it over the ranks itself)")

    def _call_index(self, mb: Any, call: _Call) -> torch.Tensor:
        """[L] index in the call of each local token's datum (-1 for padding)."""
        seg, sid = mb.batch.seg, mb.batch.sample_ids
        if sid.numel() == 0:
            return torch.full_like(seg, -1)
        position = {key: i for i, key in enumerate(call.keys)}  # video keys are noise keys, in any order
        index = torch.tensor([position[int(k)] for k in sid.tolist()], dtype=torch.long, device=seg.device)
        return torch.where(seg >= 0, index[seg.clamp(min=0)], torch.full_like(seg, -1))

    # -- the API ------------------------------------------------------------------------------------

    def forward_backward(self, batch: list[Any], loss_fn: LossFn | None = None) -> dict[str, int]:
        """Forward + backward of one call (the same full batch on every rank).

        batch: Datums (mode=llm), VideoDatums (mode=video) or dataset sample ids.
        loss_fn: sft_loss() (default), grpo_loss(...), dpo_loss(...), ... (posttrain/losses.py).
        Back-propagates Σ a_t·l_t and adds the call's global counts to the accumulator.
        Returns the call's counts: num_loss_tokens, num_sequences (pairs for DPO).
        """
        loss_fn = sft_loss() if loss_fn is None else loss_fn
        if not isinstance(loss_fn, LossFn):
            raise TypeError(f"loss_fn is a {type(loss_fn).__name__}; use sft_loss(), grpo_loss(), dpo_loss(), ...")
        call = self._make_call(batch, loss_fn)
        tr = self._trainer
        micro = tr.prepare(tr.spread(call.keys, call.lengths), self.step_count, task=call.task)
        counts = tr.sync_counts(micro)
        coef, examples_loss = None, None
        if loss_fn.sequence_level:
            coef, examples_loss = self._sequence_terms(call, micro, loss_fn, counts)
        call_loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for k, mb in enumerate(micro):
            b = mb.batch
            w = b.tokens.get("weights", b.valid.float())
            with tr.gradient_sync(False), tr.autocast():  # reduced once, at optim_step
                x = self._token_inputs(mb, call)
                if coef is not None:
                    idx = self._call_index(mb, call)
                    x.coef = coef[idx.clamp(min=0)] * (idx >= 0)
                per_token, stats = loss_fn.token_loss(x)
                loss = (per_token.float() * loss_fn.aggregation_weights(w, b.seg, b.valid, counts, k)).sum()
                loss.backward()
            call_loss += loss.detach().double()
            self._add_token_stats(stats, w, b.valid)
        self._pending_sync = True
        self._raw_sums.add(loss_fn.raw_sum)
        self._stream += len(call.keys)
        examples = counts.num_samples // loss_fn.group_size
        self.num_loss_tokens += counts.num_tokens
        self.num_sequences += examples
        # the reported loss: the surrogate's value is the loss for token losses; sequence-level
        # losses report their per-example values (known in full on every rank: counted once)
        if examples_loss is None:
            self._loss_sum += call_loss
        elif self.ctx.rank == 0:
            self._loss_sum += examples_loss
        return {"num_loss_tokens": counts.num_tokens, "num_sequences": examples}

    def _token_inputs(self, mb: Any, call: _Call) -> TokenInputs:
        """What the loss sees of micro-batch `mb` (inside autocast): the task's per-token loss and
        the caller's per-token fields, or a reward task's own inputs (velocity, target, ...)."""
        b = mb.batch
        if hasattr(call.task, "token_inputs"):
            return call.task.token_inputs(self.model, b, mb.attn)
        nll = self._trainer.per_token_loss(mb, call.task).float()
        return TokenInputs(nll, b.valid, {f: b.tokens[f] for f in TOKEN_FIELDS[1:] if f in b.tokens})

    def _sequence_terms(self, call: _Call, micro: list, loss_fn: LossFn, counts: Any
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics pass of a sequence-level loss: a no-grad forward gives this rank's
        parts of every datum's statistic π_b = Σ_t w_t·statistic_t (w_t: the caller's weights;
        video: 1/T_b, the clip's token mean), the statistics sync sums them over all ranks
        (a CP-split sequence's parts live on several ranks; a pair's sequences may live on
        different DP ranks), and the loss turns the full sums into constant per-sequence
        coefficients. Returns (coef [S] on the device, the call's reported loss)."""
        tr, dev = self._trainer, self.ctx.device
        policy = torch.zeros(len(call.keys), dtype=torch.float64, device=dev)
        with torch.no_grad(), tr.autocast():
            for k, mb in enumerate(micro):
                b = mb.batch
                w = b.tokens["weights"] if "weights" in b.tokens else inverse_sample_tokens(b.seg, b.valid, counts, k)
                keep = b.valid
                part = w[keep].double() * loss_fn.statistic(self._token_inputs(mb, call))[keep].double()
                policy.index_add_(0, self._call_index(mb, call)[keep], part)
        sync_sequence_sums(policy, self.ctx.world_group)
        inputs = call.seq_inputs
        if inputs is None:
            inputs = {"reference": torch.stack([(d.weights[1:].double() * d.ref_logprobs[1:].double()).sum()
                                                for d in call.datums])}
        coef, losses, stats = loss_fn.sequence_terms(policy.cpu(), **inputs)
        for name, values in stats.items():  # global values: counted on rank 0 only
            if self.ctx.rank == 0:
                self._add_stat(name, values.sum(), float(values.numel()))
            else:
                self._add_stat(name, 0.0, 0.0)
        total = losses.sum()
        if not loss_fn.raw_sum:
            total = total / max(1, counts.num_samples // loss_fn.group_size)
        return coef.to(device=dev, dtype=torch.float32), total.to(dev)

    def _add_stat(self, name: str, value: Any, weight: Any) -> None:
        acc = self._stats.setdefault(name, torch.zeros(2, dtype=torch.float64, device=self.ctx.device))
        acc += torch.stack([torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(weight, dtype=torch.float64)]
                           ).to(acc.device)

    def _add_token_stats(self, stats: dict[str, torch.Tensor], w: torch.Tensor, valid: torch.Tensor) -> None:
        """Weighted sums Σ w·v and Σ w of per-token statistics over this rank's loss tokens."""
        wv = torch.where(valid, w.double(), torch.zeros_like(w, dtype=torch.float64))
        for name, v in stats.items():
            self._add_stat(name, (wv * v.detach().double()).sum(), wv.sum())

    def optim_step(self, normalization: str = "num_loss_tokens", max_grad_norm: float | None = None) -> dict[str, Any]:
        """Scale gradients by 1/accumulated count, clip, step, zero, reset the accumulator.

        normalization: "num_loss_tokens" (tokens with non-zero weight), "num_sequences"
        (sequences with at least one; pairs for DPO) or "none". Returns the step's loss (as
        normalized), grad_norm, lr, counts and the losses' statistics (weighted means).
        """
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={normalization!r} must be one of {NORMALIZATIONS}")
        if normalization != "none" and False in self._raw_sums:
            raise DoubleNormalizationError(
                f"optim_step(normalization={normalization!r}) would divide gradients by a count, but a "
                f"forward_backward call used a pre-normalized loss (raw_sum=False): the gradient would be "
                f"normalized twice. Use raw-sum losses (raw_sum=True) with {normalization!r}, or "
                f"optim_step(normalization='none') with pre-normalized losses.")
        if self._pending_sync:
            self._trainer.flush_unreduced_gradients(self.step_count)
        count = {"num_loss_tokens": self.num_loss_tokens, "num_sequences": self.num_sequences, "none": 1}[normalization]
        scale = 1.0 / count if count > 0 else 0.0
        lr = self.scheduler.get_last_lr()[0]
        norm, skipped = self._trainer.apply_gradients(grad_scale=scale, max_grad_norm=max_grad_norm)
        names = sorted(self._stats)  # the same on every rank: every rank ran the same losses
        totals = torch.cat([self._loss_sum.view(1)] + [self._stats[n] for n in names])
        if self.ctx.world_group is not None:  # the reported figures: one detached all-reduce per step
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.ctx.world_group)
        out = {"loss": float(totals[0]) * scale, "grad_norm": float(norm), "lr": lr,
               "num_loss_tokens": self.num_loss_tokens, "num_sequences": self.num_sequences, "skipped": skipped}
        for i, name in enumerate(names):
            s, n = float(totals[1 + 2 * i]), float(totals[2 + 2 * i])
            out[name] = s / n if n > 0 else float("nan")
        self.step_count += 1
        self._reset()
        return out

    @torch.no_grad()
    def forward(self, batch: list[Datum]) -> list[torch.Tensor]:
        """Per-token log-probs of the caller's sequences under the current weights (mode=llm).

        Returns, in the caller's order, one [T] float32 CPU tensor per datum: [t] = log p(tokens[t]
        | tokens[:t]), [0] = 0 — the layout Datum's old_logprobs / ref_logprobs take. Every
        position is computed by exactly one rank and gathered to every rank (a SUM of values
        with zeros elsewhere: exact), so the result does not depend on the layout. Weights are
        ignored: every position is scored.
        """
        if self.cfg.mode != "llm":
            raise ValueError("forward returns token log-probs: mode=llm only")
        call = self._make_call(batch, None, all_valid=True)
        tr, dev = self._trainer, self.ctx.device
        micro = tr.prepare(tr.spread(call.keys, call.lengths), self.step_count, task=call.task)
        sizes = [d.tokens.numel() for d in call.datums]
        starts = torch.tensor([0] + sizes[:-1], device=dev).cumsum(0)
        flat = torch.zeros(sum(sizes), dtype=torch.float64, device=dev)
        for mb in micro:
            with tr.autocast():
                nll = tr.per_token_loss(mb, call.task)
            idx = self._call_index(mb, call)
            keep = idx >= 0
            flat[starts[idx[keep]] + mb.batch.order[keep] + 1] = -nll[keep].double()
        sync_sequence_sums(flat, self.ctx.world_group)
        return [t.float() for t in flat.cpu().split(sizes)]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int = 0, temperature: float = 1.0,
                 seed: int = 0) -> list[list[int]]:
        """Continue each prompt with the current weights (mode=llm; `dit_train.generate.generate_batch`:
        greedy when top_k == 0, prompt i sampled with seed + i). Rank 0 samples from the gathered
        full weights and broadcasts: every rank gets the same sequences (prompt + continuation)."""
        if self.cfg.mode != "llm":
            raise ValueError("generate samples text: mode=llm only")
        check_prompts(prompts, self.cfg.model.vocab_size)  # on every rank, before the collective
        sd = full_state_dict(self.model)  # a collective under FSDP: every rank
        box: list[Any] = [None]
        if self.ctx.is_main:
            model = build_model(self.cfg.model)
            model.load_state_dict(sd)
            model.eval()
            box[0] = generate_batch(model, [list(p) for p in prompts], max_new_tokens, top_k, temperature, seed)
        if self.ctx.world_group is not None:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full unsharded weights (a collective under FSDP: call on every rank)."""
        return full_state_dict(self.model)

    def save(self, path: str | Path, export: bool = True) -> Path:
        """Checkpoint (every rank): path/checkpoints/step_<steps taken>/ holds weights, optimizer,
        LR schedule, EMA and counters, sharded by parameter name (DCP) so that `load` resumes
        exactly on any layout. export: also path/weights.safetensors and path/config.yaml (what
        `dit_train.generate.load_run(path)` reads). Returns the checkpoint directory."""
        if self._pending_sync:
            raise ValueError("save() between forward_backward and optim_step: the accumulated gradients are not part "
                             "of a checkpoint; call optim_step first")
        ckpt = save_checkpoint(path, self.step_count, self.run.checkpoint_parts(), to_yaml(self.cfg), keep_last=0)
        if export:
            self.export(path)
        return ckpt

    def export(self, path: str | Path) -> Path:
        """Full weights as path/weights.safetensors (+ weights_ema.safetensors with EMA) and the
        config as path/config.yaml, like a training run's end (every rank calls it)."""
        path = Path(path)
        if self.ctx.is_main:
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.yaml").write_text(to_yaml(self.cfg))
        export_weights(self.model, path / "weights.safetensors", self.ctx.is_main)
        if self.run.ema is not None:
            ema = self.run.ema.full_state_dict()
            if self.ctx.is_main:
                save_safetensors(ema, path / "weights_ema.safetensors")
        return path / "weights.safetensors"

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = (),
             ctx: ParallelContext | None = None) -> "TrainingSession":
        """Resume a saved session (every rank): `path` is a checkpoint dir or a dir holding
        checkpoints/ (the newest is taken). overrides change the stored config, e.g. the layout:
        `TrainingSession.load(path, ["parallel.dp_shard=2"])`. ctx: as in the constructor."""
        ckpt = find_checkpoint(path)  # verified; a forged one is refused (UnsafeCheckpoint) before anything loads
        if ckpt is None:
            raise FileNotFoundError(f"{path}: no checkpoint there (a checkpoints/step_XXXXXXXX dir, or a dir holding one)")
        session = cls(apply_overrides(load_config(ckpt), overrides), ctx=ctx)
        session.step_count = load_checkpoint(ckpt, session.run.checkpoint_parts())
        return session
