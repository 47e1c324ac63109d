"""One DMD2 distillation step on three models (docs/distillation.md):

    step s:  [s % distill.student_every == 0]  the student's distribution-matching update
             then always                        the critic's flow-matching update

Both reuse the plain trainer's pieces (engine/trainer.py): the step plan, the packs split over
CP, the metadata sync (T_b within CP, B_global across DP), the token weights of loss.reduction,
gradient sync on the last micro-batch only (SUM over DP × CP), clipping and the optimizer. The
teacher is frozen (no gradients, sharded like the others). Which module computes what is
`roles` (distill/roles.py: three modules, or one LoRA base with two adapters).

The student's loss needs one statistic of each whole sample — DMD's normaliser
mean|x̂0 − x0_real| — while CP splits a sample's tokens over ranks: a no-grad pass computes each
rank's part of every sample's sum, one all-reduce over the world group (`sync_sequence_sums`)
completes them, and the normaliser enters the backward pass as a constant. No gradient crosses
a collective except FSDP's/DDP's own SUM.

How the student's sample is made and differentiated are three hooks (`generate`, `trained_x0`,
`scoring`); Self-Forcing (distill/self_forcing.py) overrides them, everything else is shared.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dit_train.batch import video_forward
from dit_train.config import DistillConfig
from dit_train.data_pipelines.packing import plan_step
from dit_train.distill.dmd import dmd_direction, dmd_token_loss, guided, per_token, x0_from_velocity
from dit_train.distill.roles import Roles
from dit_train.distill.task import DistillTask, student_index
from dit_train.engine.trainer import MicroBatch, StepResult, Trainer
from dit_train.loss import StepCounts, sync_sequence_sums, token_weights, weighted_loss
from dit_train.objectives.flow_matching import velocity_from_output
from dit_train.parallel.parallelize import sync_unsharded_grads


class DistillTrainer:
    """Quacks like engine.trainer.Trainer for the worker's loop (step, skip counters, EMA,
    state), driving the student's and the critic's Trainers and the frozen teacher."""

    def __init__(self, student: Trainer, critic: Trainer, roles: Roles, task: DistillTask, distill: DistillConfig):
        self.student, self.critic, self.roles, self.task, self.cfg = student, critic, roles, task, distill
        self.ctx = student.ctx
        self.loss_scale = None  # fp16 is refused for distillation (distill/config.py)

    # -- what the worker's loop reads ------------------------------------------------------------

    @property
    def ema(self):
        return self.student.ema

    @property
    def skipped_total(self) -> int:
        return self.student.skipped_total + self.critic.skipped_total

    @property
    def skipped_in_a_row(self) -> int:
        return max(self.student.skipped_in_a_row, self.critic.skipped_in_a_row)

    def autocast(self):
        return self.student.autocast()

    def heldout_loss(self, task: Any) -> dict[str, float]:
        return self.student.heldout_loss(task)

    def state_dict(self) -> dict[str, Any]:
        return self.student.state_dict()  # the critic's counters are the "critic_trainer" part

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.student.load_state_dict(state)

    # -- model calls -------------------------------------------------------------------------------

    def velocity(self, who: str, mb: MicroBatch, x: torch.Tensor, t: torch.Tensor,
                 null: bool = False) -> torch.Tensor:
        """[L, D] the velocity `who` (student, critic, teacher) predicts at the local tokens x,
        per-sample noise levels t [S]; with the pack's captions, or the empty caption when `null`.
        A differentiable call's backward must run inside `roles.use(who)` too (LoRA)."""
        b = mb.batch
        with self.roles.use(who) as model:
            out = video_forward(model, b, mb.attn, x=x, t=t, captions="null_context" if null else "context").float()
        return velocity_from_output(out, x, per_token(t, b.seg)[:, 0], self.task.prediction, self.task.x0_min_t)

    def student_x0(self, mb: MicroBatch, x_j: torch.Tensor, j: int) -> torch.Tensor:
        """x̂0 of the student's step j from x_j (differentiable when grad is enabled)."""
        sig = mb.batch.samples["sigmas"][:, j]
        return x0_from_velocity(x_j, self.velocity("student", mb, x_j, sig), per_token(sig, mb.batch.seg))

    @torch.no_grad()
    def simulate(self, mb: MicroBatch, start: str, j: int) -> torch.Tensor:
        """x_j: the student's Euler steps 0..j−1 from the noise tokens[start] (no gradient;
        DMD2's backward simulation): x ← x + (σ_{k+1} − σ_k)·v(x, σ_k)."""
        b = mb.batch
        x, sig = b.tokens[start].float(), b.samples["sigmas"]
        for k in range(j):
            v = self.velocity("student", mb, x, sig[:, k])
            x = x + (per_token(sig[:, k + 1], b.seg, 0.0) - per_token(sig[:, k], b.seg, 0.0)) * v
        return x

    # -- what Self-Forcing changes (distill/self_forcing.py) ----------------------------------------

    def generate(self, mb: MicroBatch, start: str, j: int) -> tuple[torch.Tensor, Any]:
        """(the student's sample x̂0 [L, D] from the noise tokens[start], what `trained_x0`
        needs to recompute it with gradient), no gradient: DMD2's step j from x_j."""
        x_j = self.simulate(mb, start, j)
        return self.student_x0(mb, x_j, j), x_j

    def trained_x0(self, mb: MicroBatch, state: Any, j: int) -> list[tuple[torch.Tensor | None, Any, Any]]:
        """[(token mask [L] or None = all, a callable giving x̂0 [L, D] with gradient, the context
        its forward and backward run in)]: the student's sample in the parts it is
        differentiated in (one backward each)."""
        return [(None, lambda: self.student_x0(mb, state, j), contextlib.nullcontext)]

    def scoring(self, mb: MicroBatch) -> MicroBatch:
        """The micro-batch as the teacher and the critic read it (their attention layout)."""
        return mb

    # -- the step ----------------------------------------------------------------------------------

    def step_samples(self, step: int) -> dict[int, int]:
        """{sample id: row} of every sample of the step over all DP ranks (the statistics sync's
        index; a pure function of the step)."""
        t = self.student.train_cfg
        plan = plan_step(step, self.student.lengths, t.global_batch, self.ctx.dims.dp, t.grad_accum,
                         t.micro_batch_tokens, t.seed, t.batch_warmup_steps, t.batch_warmup_start)
        ids = sorted({i for rank in plan.micro_batches for pack in rank for i in pack})
        return {sid: row for row, sid in enumerate(ids)}

    def step(self, step: int) -> StepResult:
        micro = self.student.prepare(self.student.plan(step), step, task=self.task)
        counts = self.student.sync_counts(micro)
        sums = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # critic loss, DMD loss, dropped
        extras: dict[str, float] = {}
        skipped = False
        if step % self.cfg.student_every == 0:
            dmd, norm, skipped = self.student_step(step, micro, counts)
            sums[1] = dmd
            extras["student_grad_norm"] = float(norm)
        sums[0], c_norm, c_skipped = self.critic_step(step, micro, counts)
        sums[2] = float(self.student.dropped if self.ctx.cp_rank == 0 else 0)
        if self.ctx.world_group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.ctx.world_group)
        if "student_grad_norm" in extras:
            extras["dmd_loss"] = float(sums[1])
        return StepResult(loss=float(sums[0]), grad_norm=float(c_norm), tokens=counts.num_tokens,
                          samples=counts.num_samples, micro_batches=len(micro), skipped=skipped or c_skipped,
                          dropped=int(sums[2]), extras=extras)

    def student_step(self, step: int, micro: list[MicroBatch], counts: StepCounts) -> tuple[torch.Tensor, Any, bool]:
        """The distribution-matching update of the student. Returns (this rank's Σ w·l, the
        global gradient norm, skipped)."""
        j = student_index(self.student.train_cfg.seed, step, "distill_student", self.cfg.student_steps)
        rows = self.step_samples(step)
        totals = torch.zeros(len(rows), dtype=torch.float64, device=self.ctx.device)  # Σ_t w·Σ_D |x̂0 − x0_real|
        kept = []
        for mb in micro:  # pass 1, no gradient: the directions and this rank's parts of the normalisers
            b = mb.batch
            with torch.no_grad(), self.student.autocast():
                x0_hat, state = self.generate(mb, "x", j)
                mb = self.scoring(mb)  # the teacher's and the critic's attention (bidirectional)
                t = b.samples["t_dmd"]
                t_tok = per_token(t, b.seg)
                x_t = (1 - t_tok) * x0_hat + t_tok * b.tokens["eps"]
                g = self.cfg.teacher_guidance
                v_u = self.velocity("teacher", mb, x_t, t, null=True) if g != 1.0 and self.task.text_dim else None
                x0_real = x0_from_velocity(x_t, guided(self.velocity("teacher", mb, x_t, t), v_u, g), t_tok)
                x0_fake = x0_from_velocity(x_t, self.velocity("critic", mb, x_t, t), t_tok)
            keep = b.seg >= 0
            if bool(keep.any()):
                row = torch.tensor([rows[int(s)] for s in b.sample_ids], device=totals.device)[b.seg[keep]]
                part = (x0_hat - x0_real).abs().sum(dim=-1).double() * b.loss_weight().double()
                totals.index_add_(0, row, part[keep])
            kept.append((state, x0_fake - x0_real))
        sync_sequence_sums(totals, self.ctx.world_group)
        loss_sum = torch.zeros((), device=self.ctx.device)
        D = self.task.patch_dim
        for k, (mb, (state, diff)) in enumerate(zip(micro, kept)):  # pass 2: the student's gradient
            b = mb.batch
            sample_rows = torch.tensor([rows[int(s)] for s in b.sample_ids], dtype=torch.long, device=totals.device)
            normaliser = totals[sample_rows] / (counts.sample_tokens[k].to(totals.device) * D)
            direction = dmd_direction(diff, per_token(normaliser.float(), b.seg))
            weights = token_weights(self.student.loss_cfg.reduction, b.seg, b.loss_weight(), counts, k)
            parts = self.trained_x0(mb, state, j)
            for n, (part, x0_hat, scope) in enumerate(parts):  # the trained x̂0, whole or a part (mask [L]) at a time
                last = k == len(micro) - 1 and n == len(parts) - 1
                with scope(), self.roles.use("student"), self.student.gradient_sync(last), self.student.autocast():
                    per_tok = dmd_token_loss(x0_hat(), direction)
                    loss = weighted_loss(per_tok if part is None else per_tok * part, weights)
                    loss.backward()
                loss_sum += loss.detach()
        sync_unsharded_grads(self.student.model, self.student._manual_sync, self.ctx)
        norm, skipped = self.student.apply_gradients()
        return loss_sum, norm, skipped

    def critic_step(self, step: int, micro: list[MicroBatch], counts: StepCounts) -> tuple[torch.Tensor, Any, bool]:
        """The critic's flow-matching update on the student's (detached) samples x̂0."""
        j = student_index(self.student.train_cfg.seed, step, "distill_critic", self.cfg.student_steps)
        loss_sum = torch.zeros((), device=self.ctx.device)
        for k, mb in enumerate(micro):
            b = mb.batch
            with torch.no_grad(), self.student.autocast():
                x0_hat = self.generate(mb, "x_c", j)[0]
            mb = self.scoring(mb)
            t = b.samples["t_c"]
            t_tok, eps = per_token(t, b.seg), b.tokens["eps_c"]
            fm = replace(b, tokens={"x": (1 - t_tok) * x0_hat + t_tok * eps, "target": eps - x0_hat},
                         samples={**b.samples, "t": t})
            with self.roles.use("critic"), self.critic.gradient_sync(k == len(micro) - 1), self.critic.autocast():
                per_tok = self.critic.per_token_loss(MicroBatch(fm, mb.attn), task=self.task.base)
                loss = weighted_loss(per_tok, token_weights(self.critic.loss_cfg.reduction, b.seg, b.loss_weight(),
                                                            counts, k))
                loss.backward()
            loss_sum += loss.detach()
        sync_unsharded_grads(self.critic.model, self.critic._manual_sync, self.ctx)
        norm, skipped = self.critic.apply_gradients()
        return loss_sum, norm, skipped
