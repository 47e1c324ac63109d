"""The packs a distillation step runs on: for each sample of the step plan (the data's clip
sizes and captions; its pixels are not used), everything random the step needs, drawn as a pure
function of (seed, sample id, step) so no layout can change it:

    stream "distill_student": t_dmd ~ U[t_min, t_max], the student's start noise, the DMD noise
    stream "distill_critic":  t_c (the data's timestep distribution and shift), the student's
                              start noise, the critic's flow-matching noise

tokens (each [L, D]): "x" (student start, student step), "eps" (DMD noise), "x_c" (student
start, critic step), "eps_c" (critic noise); samples: "sigmas" [S, K+1] (each clip's student
grid, `dmd.student_sigmas` with its own shift), "t_dmd", "t_c" [S], the captions ("context",
"context_len") and the empty caption ("null_context", "null_context_len") for the teacher's
guidance. The step index j of the student's backward simulation is one draw per step
(`student_index`): every rank runs the same number of forwards (FSDP's collectives must match).

Self-Forcing (distill.method=self_forcing, a block-causal student): the packs are block-causal
(each token's `block`, clips trimmed to whole blocks as causal training trims them), and each
sample draws the exit step of every block of its two rollouts from its own stream
"rollout_exit": samples "exit" and "exit_c" [S, NB] int64 (NB = `max_blocks`, the longest
clip's block count, the same in every pack; a shorter clip's extra columns are unused).
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from dit_train.batch import PackedBatch, video_forward
from dit_train.config import DistillConfig, LossConfig
from dit_train.data_pipelines.video_io import VideoReadError
from dit_train.distill.dmd import student_sigmas
from dit_train.objectives.flow_matching import sample_shift, sample_timestep, shift_timestep
from dit_train.rng import sample_generator
from dit_train.tasks.captions import pad_contexts
from dit_train.tasks.causal import kept_frames
from dit_train.tasks.video import num_patches, pack_clips

log = logging.getLogger(__name__)


def student_index(seed: int, step: int, which: str, steps: int) -> int:
    """j ∈ {0..K−1}: the student step whose output x̂0 is trained (`which`: "distill_student" or
    "distill_critic"); a function of (seed, step) only."""
    return int(torch.randint(steps, (), generator=sample_generator(seed, -1, step, which)))


class DistillTask:
    """Builds distillation packs from a video data task `base` (its dataset, patch, captions)."""

    causal = False
    cp_layout = "contiguous"

    def __init__(self, base: Any, distill: DistillConfig, loss_cfg: LossConfig, seed: int):
        self.base, self.distill, self.loss_cfg, self.seed = base, distill, loss_cfg, seed
        self.patch, self.patch_dim, self.text_dim = base.patch, base.patch_dim, base.text_dim
        self.prediction, self.x0_min_t = base.prediction, base.x0_min_t
        self._sigmas: dict[float, tuple[float, ...]] = {}
        # Self-Forcing: temporal patches per causal block of the (block-causal) student's task
        self.causal_block = getattr(base, "causal_block", 0) if distill.method == "self_forcing" else 0
        self.block_frames = self.causal_block * self.patch[0]
        if self.causal_block:
            self.causal, self.cp_layout = True, "zigzag"  # as the causal video task: balanced ring work
            frames = base.dataset.frames  # clip lengths without decoding (the causal task needs them too)
            longest = max(kept_frames(frames(i), self.block_frames) for i in range(len(base.dataset)))
            self.max_blocks = max(1, math.ceil(longest / self.block_frames))

    def lengths(self) -> list[int]:
        return self.base.lengths()

    def sigmas(self, shift: float) -> tuple[float, ...]:
        """The student's grid for a clip of this shift (computed once per shift)."""
        if shift not in self._sigmas:
            self._sigmas[shift] = tuple(student_sigmas(self.distill.student_steps, shift))
        return self._sigmas[shift]

    def build(self, sample_ids: list[int], step: int) -> PackedBatch:
        """The full (un-split) pack of `sample_ids` at `step` (CPU)."""
        d, lc = self.distill, self.loss_cfg
        fields: dict[str, list[torch.Tensor]] = {"x": [], "eps": [], "x_c": [], "eps_c": []}
        sig, t_dmd, t_c, ctx, kept, exits = [], [], [], [], [], []
        for sid in sample_ids:
            try:
                item = self.base.dataset[sid]
                shape = item.pixels.shape
            except VideoReadError as err:  # skip and count, like training (tasks/video.py)
                if sid not in self.base.failed:
                    log.warning("dropping sample %d: %s", sid, err)
                    self.base.failure_reasons[sid] = str(err)
                self.base.failed.add(sid)
                continue
            kept.append(sid)
            if self.causal_block:  # whole causal blocks, as causal training takes the clip (tasks/causal.py)
                shape = (shape[0], kept_frames(shape[1], self.block_frames), *shape[2:])
                g = sample_generator(self.seed, sid, step, "rollout_exit")  # [2, NB]: the student's, the critic's
                exits.append(torch.randint(d.student_steps, (2, self.max_blocks), generator=g))
            shift = sample_shift(lc.timestep_shift, lc.shift_reference_tokens, num_patches(shape, self.patch))
            sig.append(self.sigmas(shift))
            g = sample_generator(self.seed, sid, step, "distill_student")
            t_dmd.append(d.t_min + (d.t_max - d.t_min) * float(torch.rand((), generator=g)))
            fields["x"].append(torch.randn(shape, generator=g))
            fields["eps"].append(torch.randn(shape, generator=g))
            g = sample_generator(self.seed, sid, step, "distill_critic")
            t_c.append(float(shift_timestep(sample_timestep(g, lc), shift)))
            fields["x_c"].append(torch.randn(shape, generator=g))
            fields["eps_c"].append(torch.randn(shape, generator=g))
            if self.text_dim:
                ctx.append(self.base.caption_embedding(item))
        samples = {"t": torch.zeros(len(kept)), "t_dmd": torch.tensor(t_dmd, dtype=torch.float32),
                   "t_c": torch.tensor(t_c, dtype=torch.float32),
                   "sigmas": torch.tensor(sig, dtype=torch.float32).view(len(kept), d.student_steps + 1)}
        if self.text_dim:
            samples["context"], samples["context_len"] = pad_contexts(ctx, self.text_dim)
            null = [self.base.null_caption()] * len(kept)
            samples["null_context"], samples["null_context_len"] = pad_contexts(null, self.text_dim)
        if self.causal_block:
            both = torch.stack(exits) if exits else torch.zeros(0, 2, self.max_blocks, dtype=torch.long)
            samples["exit"], samples["exit_c"] = both[:, 0], both[:, 1]
        return pack_clips(fields, self.patch, self.patch_dim, samples, torch.tensor(kept, dtype=torch.long),
                          causal_block=self.causal_block)

    def per_token_loss(self, model: nn.Module, batch: PackedBatch, attn: Any) -> torch.Tensor:
        """[L] a plain forward's mean output per token: what the trainer's gradient flush runs
        (an empty pack, times 0) to make the DP wrapper reduce the step's gradients."""
        out = video_forward(model, batch, attn)
        return out.float().mean(dim=-1)
