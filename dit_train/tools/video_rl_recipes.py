"""The recipes of `tools.video_rl` as a table (`RECIPES`): what each trains on a step, and what
the loop must prepare for it (rollouts, the SDE sampler, the frozen reference). The loop asks a
`Recipe`, never the recipe's name, so a new recipe is one entry here (docs/video-rl.md).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dit_train.data_pipelines import open_dataset
from dit_train.posttrain import (VideoDatum, diffusion_dpo_loss, diffusion_nft_loss, flow_grpo_loss, flow_grpo_steps,
                                 group_advantages, sft_loss, transitions)


def accepted(rewards: list[float], keep_min: float, group: int = 1, select: str = "all") -> list[int]:
    """Indices of the clips raft keeps (rejection sampling), in order.

    select="all": every clip whose reward reaches keep_min. select="best": of each caption's
    group (`group` consecutive clips), the first clip of the highest reward, if it reaches
    keep_min (relative acceptance: the floor keeps a group whose clips all fail from teaching)."""
    if select == "all":
        return [i for i, r in enumerate(rewards) if r >= keep_min]
    best = (max(range(g, min(g + group, len(rewards))), key=rewards.__getitem__) for g in range(0, len(rewards), group))
    return [i for i in best if rewards[i] >= keep_min]


class RaftBuffer:
    """The accepted clips so far (the newest `capacity`), and minibatches drawn from them.

    Every rank holds the same buffer and draws with the same seeded rng (the rollouts are
    broadcast and the rewards deterministic), so every rank trains the same datums."""

    def __init__(self, capacity: int = 512, seed: int = 0):
        self.clips: list[tuple[torch.Tensor, str]] = []
        self.capacity, self.rng, self.added = capacity, random.Random(seed), 0

    def add(self, rollouts, indices: list[int]) -> None:
        self.clips += [(rollouts[i].clip.clamp(-1, 1), rollouts[i].caption) for i in indices]
        self.added += len(indices)
        del self.clips[:-self.capacity]

    def batch(self, size: int) -> list[VideoDatum]:
        """Up to `size` distinct buffered clips; noise keys distinct within the call."""
        picks = self.rng.sample(range(len(self.clips)), min(size, len(self.clips)))
        return [VideoDatum(pixels=self.clips[j][0], caption=self.clips[j][1], noise_key=k) for k, j in enumerate(picks)]


def data_clips(cfg, seed: int = 0) -> RaftBuffer:
    """The baseline `--recipe sft`'s clips: a buffer holding the run's own training clips (plain
    flow matching on its data, what the run would have trained on next), drawn as raft draws
    from its accepted clips (the same seeded rng on every rank)."""
    ds = open_dataset(cfg.data, cfg.model)
    clips = RaftBuffer(capacity=len(ds), seed=seed)
    clips.clips = [(s.pixels, s.caption) for s in (ds[i] for i in range(len(ds)))]
    return clips


def sft_updates(session, clips: RaftBuffer, updates: int, size: int) -> tuple[dict, int]:
    """`updates` optimizer steps of sft_loss(agg="sequence") on `size` clips drawn from `clips`
    each, normalized by num_sequences: (the last step's stats, datums trained)."""
    stats, n = {}, 0
    for _ in range(updates):
        batch = clips.batch(size)
        session.forward_backward(batch, sft_loss(agg="sequence"))
        stats, n = session.optim_step("num_sequences"), n + len(batch)
    return stats, n


@dataclass
class StepInputs:
    """What one step's update works on: the session and the frozen reference (None unless a
    recipe or --kl needs it), the step's rollouts and their rewards (None and [0.0] without
    rollouts), raft's buffer, sft's clips of the run (None for the others), and the flags."""

    session: Any
    reference: Any
    rollouts: list | None
    rewards: list[float]
    group: int
    step: int
    kl: float
    buffer: RaftBuffer
    data: RaftBuffer | None
    keep_min: float
    select: str
    updates: int
    min_buffer: int
    raft_batch: int


def nft_batch(u: StepInputs) -> tuple[list, Any, str]:
    """DiffusionNFT: each clip with a signal (advantage ≠ 0), normalized by num_loss_tokens. With
    an old policy (--old-decay: the session's EMA, which also sampled the rollouts) each clip
    carries its velocity under the old weights, on the same noise as the update's."""
    adv = group_advantages(u.rewards, u.group)
    batch = [VideoDatum(pixels=r.clip.clamp(-1, 1), caption=r.caption, noise_key=i, advantages=a)
             for i, (r, a) in enumerate(zip(u.rollouts, adv)) if a != 0]
    ema = u.session.run.ema  # the old policy (--old-decay), when the session keeps one
    if ema is not None and batch:
        with ema.swapped_in():
            olds = u.session.clip_velocities(batch, step=u.session.step_count)
        for d, v in zip(batch, olds):
            d.old_velocity = v
    return batch, diffusion_nft_loss(), "num_loss_tokens"


def grpo_batch(u: StepInputs) -> tuple[list, Any, str]:
    """Flow-GRPO: the transitions of each clip with a signal but its last (flow_grpo_steps, as
    Flow-GRPO trains; + the reference's means with --kl), normalized by num_sequences (transitions)."""
    adv = group_advantages(u.rewards, u.group)
    batch = [t for r, a in zip(u.rollouts, adv) if a != 0 for t in transitions(r, a, flow_grpo_steps(r))]
    if u.kl and batch:
        for t, mean in zip(batch, u.reference.transition_means(batch)):
            t.ref_mean = mean
    return batch, flow_grpo_loss(kl_coef=u.kl), "num_sequences"


def dpo_batch(u: StepInputs) -> tuple[list, Any, str]:
    """Diffusion-DPO: each group's best and worst clip as (chosen, rejected) when their rewards
    differ, the reference's errors on them; normalized by num_sequences (pairs)."""
    pairs = []
    for g in range(0, len(u.rollouts), u.group):
        rs = u.rewards[g:g + u.group]
        best, worst = max(range(u.group), key=rs.__getitem__), min(range(u.group), key=rs.__getitem__)
        if rs[best] > rs[worst]:
            pairs += [u.rollouts[g + best], u.rollouts[g + worst]]
    batch = [VideoDatum(pixels=r.clip.clamp(-1, 1), caption=r.caption, noise_key=i) for i, r in enumerate(pairs)]
    if batch:
        for d, ref in zip(batch, u.reference.clip_losses(batch, step=u.session.step_count)):
            d.ref_loss = ref
    return batch, diffusion_dpo_loss(), "num_sequences"


def batch_update(make: Callable[[StepInputs], tuple[list, Any, str]]) -> Callable[[StepInputs], tuple[dict, int, dict]]:
    """The update of a recipe that trains one loss on the step's datums (`make`): one optimizer
    step when any datum carries a signal, none otherwise."""
    def update(u: StepInputs) -> tuple[dict, int, dict]:
        batch, loss, norm = make(u)
        stats = {}
        if batch:
            u.session.forward_backward(batch, loss)
            stats = u.session.optim_step(norm)
        return stats, len(batch), {}
    return update


def raft_update(u: StepInputs) -> tuple[dict, int, dict]:
    """raft: the accepted clips join the buffer; --updates steps on draws from it once it holds
    --raft-min-buffer clips."""
    keep = accepted(u.rewards, u.keep_min, u.group, u.select)
    u.buffer.add(u.rollouts, keep)
    stats, n = sft_updates(u.session, u.buffer, u.updates if len(u.buffer.clips) >= u.min_buffer else 0, u.raft_batch)
    return stats, n, {"accepted": len(keep), "buffer": u.buffer.added}


def sft_update(u: StepInputs) -> tuple[dict, int, dict]:
    """The sft baseline: --updates steps on the run's own clips."""
    return (*sft_updates(u.session, u.data, u.updates, u.raft_batch), {})


@dataclass(frozen=True)
class Recipe:
    """How a --recipe trains; the loop asks these, never the recipe's name.

    update: one step's update -> (the last optimizer step's stats, datums trained, raft's
    figures); everything the loop keeps changes there and only there. rollouts: it samples and
    scores clips each step (sft trains on the run's own clips instead); sde: Flow-GRPO's SDE
    sampler without guidance, recording transitions; reference: it needs the frozen initial
    weights whatever --kl (dpo's reference errors); old_policy: with --old-decay the session's EMA
    is its old policy (samples the rollouts, gives v_old, is what the held-out figures score)."""

    update: Callable[[StepInputs], tuple[dict, int, dict]]
    rollouts: bool = True
    sde: bool = False
    reference: bool = False
    old_policy: bool = False


RECIPES = {
    "nft": Recipe(batch_update(nft_batch), old_policy=True),
    "grpo": Recipe(batch_update(grpo_batch), sde=True),
    "dpo": Recipe(batch_update(dpo_batch), reference=True),
    "raft": Recipe(raft_update),
    "sft": Recipe(sft_update, rollouts=False),
}
