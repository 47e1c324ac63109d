"""The video side of TrainingSession (mode=video): rollouts, and the calls of the reward losses.

    rollouts = session.sample_videos(captions, size=(8, 32, 32), noise_ids=ids, sde=True)
    batch = [t for r, a in zip(rollouts, advantages) for t in transitions(r, a, flow_grpo_steps(r))]
    session.forward_backward(batch, flow_grpo_loss())
    session.optim_step("num_sequences")

Every rank calls these with the same arguments, like the rest of the session.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch

from dit_train.config.errors import ConfigError
from dit_train.config.cond import cond_active
from dit_train.loss import inverse_sample_tokens, sync_sequence_sums
from dit_train.posttrain.datums import _Call
from dit_train.posttrain.rollouts import SDESampler, VideoRollout, broadcast_from_rank0, run_id
from dit_train.posttrain.video_data import (CLIP_FIELDS, TransitionTask, VideoTransition, check_transition,
                                            rl_video_task)
from dit_train.posttrain.video_losses import DiffusionNFTLoss, FlowGRPOLoss, transition_token_logprob
from dit_train.sampling.prompts import prompt_space
from dit_train.sampling.sampler import SampleRequest, VideoSampler, run_sampling
from dit_train.tasks.video import unpatchify


class VideoSessionMixin:
    """sample_videos / clip_losses / transition_means and the video reward calls (needs the
    session's cfg, ctx, model, task, _trainer, _stream, _check_same_batch, _call_index)."""

    @functools.cached_property
    def run_id(self) -> str:
        """The id rollouts of this run carry (model, data, seed; not the layout). Once per session:
        it serializes cfg.model and cfg.data (~35 ms), which the built model no longer follows."""
        return run_id(self.cfg)

    def _video_only(self, what: str) -> None:
        if self.cfg.mode != "video":
            raise ValueError(f"{what} works on video generators: mode=video only (this session is mode={self.cfg.mode})")
        if cond_active(self.cfg.cond) or getattr(self.cfg.cond, "control", False):
            raise ConfigError(f"{what}: conditioned runs (cond.kind={self.cfg.cond.kind}, cond.control="
                              f"{str(getattr(self.cfg.cond, 'control', False)).lower()}) are not supported by the "
                              f"reward losses and rollouts yet")

    def _requests(self, captions: Any, size: tuple[int, int, int], noise_ids: Any) -> list[SampleRequest]:
        if isinstance(captions, str) or not isinstance(captions, (list, tuple)) or not captions:
            raise ValueError("captions must be a non-empty list of strings (repeat a caption for several samples)")
        for i, c in enumerate(captions):
            if not isinstance(c, str):
                raise ValueError(f"caption {i} is a {type(c).__name__}; expected a string")
        ids = list(range(len(captions))) if noise_ids is None else [int(n) for n in noise_ids]
        if len(ids) != len(captions):
            raise ValueError(f"noise_ids has {len(ids)} entries for {len(captions)} captions: give one per caption")
        space = prompt_space(self.cfg)
        shape = space.shape(*size)
        return [SampleRequest(f"rollout_{i}", shape, c, space.encode(c) if space.encode else None, n, space.fps)
                for i, (c, n) in enumerate(zip(captions, ids))], space

    @torch.no_grad()
    def sample_videos(self, captions: list[str], size: tuple[int, int, int] = (8, 32, 32), noise_ids: Any = None,
                      steps: int | None = None, guidance_scale: float | None = None, sde: bool = False,
                      eta: float = 0.7) -> list[VideoRollout]:
        """Sample one clip per caption with the current (training) weights.

        size: (frames, height, width) in pixels; noise_ids: one per caption (default 0, 1, ...):
        clip i starts from the "sampling" stream of (train.seed, noise_ids[i]) — the same clip
        on every rank and layout. steps / guidance_scale: default train.sample_steps /
        train.guidance_scale. sde=False: the run's validation sampler (Euler ODE, or the stochastic step
        with train.stochastic_sampling); sde=True: Flow-GRPO's
        SDE with noise level eta, recording latents, sigmas, stds and log-probs of each
        transition (rollouts.py). All ranks sample (FSDP / CP need them all); rank 0's result
        is broadcast, so every rank returns identical tensors.
        """
        self._video_only("sample_videos")
        requests, space = self._requests(captions, size, noise_ids)
        t, task = self.cfg.train, self.task
        g = t.guidance_scale if guidance_scale is None else float(guidance_scale)
        # an unconditioned run (_video_only): the task's inputs feed no given frames and no control
        args = (requests, task.inputs, space.null, self.ctx, steps or t.sample_steps, g, t.seed)
        rid = self.run_id
        if sde:
            trajs = SDESampler(*args, self.cfg.loss.timestep_shift, self.cfg.loss.shift_reference_tokens,
                               eta=eta).trajectories(self.model, self._trainer.autocast)
            out = [VideoRollout(r.caption, r.noise_id, tr["latents"][-1], rid, **tr) for r, tr in zip(requests, trajs)]
        else:  # the run's validation sampler (its stochastic step, experts, schedule)
            clips = VideoSampler(*args, **run_sampling(self.cfg)).sample(self.model, self._trainer.autocast)
            out = [VideoRollout(r.caption, r.noise_id, c, rid) for r, c in zip(requests, clips)]
        return broadcast_from_rank0(out, self.ctx.world_group, self.ctx.is_main)

    # -- calls -----------------------------------------------------------------------------------------

    def _video_call(self, batch: list[Any], loss_fn: Any) -> Any:
        """The _Call of a reward loss's VideoDatums or VideoTransitions (checked, fingerprinted)."""
        self._video_only(f"{loss_fn.name}_loss")
        t, m = self.cfg.train, self.cfg.model
        if loss_fn.video_inputs == "clips":
            task, keys = rl_video_task(list(batch), self._stream, m, self.cfg.loss, t.seed, t.micro_batch_tokens,
                                       loss_fn.required_fields())
            loss_fn.check(batch)
            seq = None
            if loss_fn.sequence_level:  # Diffusion-DPO: the reference's π = −(its token-mean error)
                seq = {"reference": -torch.tensor([float(d.ref_loss) for d in batch], dtype=torch.float64)}
            call = _Call(task, keys, task.sample_lengths(), seq_inputs=seq)
            content = [(tuple(c.pixels.shape), c.caption, task.scalars[k]) for k, c in task.dataset.items()]
            self._check_same_batch(call, content + [c.pixels for c in task.dataset.values()])
            return call
        needs_ref = bool(getattr(loss_fn, "kl_coef", 0.0))
        items = [check_transition(i, tr, m, t.micro_batch_tokens, self.run_id, needs_ref) for i, tr in enumerate(batch)]
        has = [it.ref_mean is not None for it in items]
        if any(has) and not all(has):
            raise ValueError(f"datum {has.index(False)}: ref_mean is missing but datum {has.index(True)} has it: give "
                             f"every datum of a call the same fields")
        keys = [self._stream + i for i in range(len(items))]
        task = TransitionTask(dict(zip(keys, items)), m, self.cfg.loss, t.seed)
        seq = {"old": torch.tensor([tr.old_logprob for tr in items], dtype=torch.float64),
               "advantages": torch.tensor([tr.advantages for tr in items], dtype=torch.float64)}
        call = _Call(task, keys, task.sample_lengths(), offset=self._stream, seq_inputs=seq)
        self._check_same_batch(call, [(tuple(tr.latents.shape), tr.caption, tr.sigma, tr.old_logprob, tr.advantages)
                                      for tr in items] + [tr.next_latents for tr in items])
        return call

    @torch.no_grad()
    def clip_losses(self, batch: list[Any], step: int | None = None) -> list[float]:
        """Each VideoDatum's token-mean flow-matching error under the current weights, with the
        noise and timestep of `step` (default this session's step count): Diffusion-DPO's
        `ref_loss` when called on the reference session with the policy's step. A sum over the
        clip's tokens (CP splits them): each rank's part, summed by the statistics sync."""
        return self._clip_statistic(batch, step, "clips")

    @torch.no_grad()
    def clip_velocities(self, batch: list[Any], step: int | None = None) -> list[torch.Tensor]:
        """Each VideoDatum's velocity under the current weights ([C, F, H, W] per clip, the clip's
        shape) on its noisy input at `step` (default this session's step count): DiffusionNFT's
        `old_velocity` when called with the old policy's weights (e.g. inside the session's
        `ema.swapped_in()`) and the policy's step. Each token is computed by one rank and summed
        over the world group (zeros elsewhere: exact)."""
        return self._clip_statistic(batch, step, "velocities")

    @torch.no_grad()
    def transition_means(self, batch: list[VideoTransition]) -> list[torch.Tensor]:
        """μ(x_k) of each transition under the current weights ([C, F, H, W] per transition):
        the KL term's `ref_mean` when called on the reference session."""
        return self._clip_statistic(batch, None, "transitions")

    def _clip_statistic(self, batch: list[Any], step: int | None, kind: str) -> list[Any]:
        on_clips = kind in ("clips", "velocities")
        probe = DiffusionNFTLoss() if on_clips else FlowGRPOLoss()
        if on_clips:  # scored as they are: the call's advantages play no part here
            batch = [replace(d, advantages=0.0, ref_loss=None, old_velocity=None) for d in batch]
        call = self._video_call(batch, probe)
        tr = self._trainer
        step = self.step_count if step is None else int(step)
        micro = tr.prepare(tr.spread(call.keys, call.lengths), step, task=call.task)
        counts = tr.sync_counts(micro)
        S, dev = len(call.keys), self.ctx.device
        sizes = [call.lengths[k] for k in call.keys]
        width = call.task.patch_dim
        flat = torch.zeros(S if kind == "clips" else sum(sizes) * width, dtype=torch.float64, device=dev)
        starts = torch.tensor([0] + sizes[:-1], device=dev).cumsum(0)
        for k, mb in enumerate(micro):
            with tr.autocast():
                x = call.task.token_inputs(self.model, mb.batch, mb.attn)
            idx = self._call_index(mb, call)
            keep = idx >= 0
            if kind == "clips":
                w = inverse_sample_tokens(mb.batch.seg, mb.batch.valid, counts, k)
                flat.index_add_(0, idx[keep], (w[keep].double() * x.nll[keep].double()))
            else:
                f = x.fields
                mean = f["velocity"] if kind == "velocities" else transition_token_logprob(
                    f["velocity"], f["x"], f["next"], f["sigma"], f["sigma_next"], f["s"], f["std"])[1]
                rows = starts[idx[keep]] + mb.batch.order[keep]
                pos = (rows[:, None] * width + torch.arange(width, device=dev)).reshape(-1)
                flat[pos] = mean[keep].reshape(-1).double()
        sync_sequence_sums(flat, self.ctx.world_group)
        if kind == "clips":
            return flat.cpu().tolist()
        out = []
        for key, part in zip(call.keys, flat.cpu().split([n * width for n in sizes])):
            item = call.task.dataset[key]
            shape = (item.pixels if on_clips else item.latents).shape
            grid = tuple(s // p for s, p in zip(shape[1:], call.task.patch))
            out.append(unpatchify(part.float().view(-1, width), grid, call.task.patch, shape[0]))
        return out

