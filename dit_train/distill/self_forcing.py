"""Self-Forcing (Huang et al. 2025): a block-causal few-step student trained on its own
autoregressive rollouts with DMD2's loss (docs/causal.md, "Self-Forcing").

The rollout of one clip, blocks b = 0..NB−1 in order, each denoised by the student's K steps on
its grid σ_0 = 1 > … > σ_K = 0 (dmd.student_sigmas) while attending to the clean results of
the blocks before it at t = 0 (the KV-cache convention of sampling/streaming.py):

    x_{b,0} = ε_b;   v = student(x_{b,i} at σ_i | x̂0_{<b} at 0);   x_{b,i+1} = x_{b,i} + (σ_{i+1} − σ_i)·v
    x̂0_b = x_{b,s_b} − σ_{s_b}·student(x_{b,s_b} at σ_{s_b} | x̂0_{<b} at 0)

with s_b the block's exit step (a per-sample draw, task.py's "rollout_exit" stream). Only that
last evaluation is differentiated: x_{b,s_b} and the history x̂0_{<b} are constants (computed
under no_grad), and so are the history's keys and values in every attention layer (`frozen_history`),
as a KV cache filled under no_grad would hold them. The clip x̂0 then takes DMD2's loss against
the bidirectional teacher and critic exactly as in trainer.py, and the critic's update trains on
a second rollout (the "_c" noise and exits) as DMD2's trains on a second simulation.

The rollout (no_grad) runs with streaming.py's KV cache, packed (`rollout_cached`): block b's K
steps run only the pack's block-b tokens, every clip's attending to its own cached history,
then one forward of those tokens' x̂0 at t = 0 commits their K/V. Under context parallelism
(Ulysses, ring) a sample's blocks and its cache would sit on several ranks, which the cache does
not do: there the rollout recomputes (`rollout_recomputed`: every step a forward of the whole
CP-split pack under the block-causal mask, the history at t = 0 — the same values, as a block's
output under the mask with its history at t = 0 is the cached forward, tests/test_streaming.py).
Every rank runs the same forwards (K per block, NB−1 commits, NB with gradient; a rank without a
block's tokens runs a stand-in token), so FSDP's and CP's collectives match whatever a rank's
samples are.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from dit_train.batch import video_forward
from dit_train.distill.dmd import per_token, x0_from_velocity
from dit_train.distill.trainer import DistillTrainer
from dit_train.engine.trainer import MicroBatch
from dit_train.kernels import VarlenLayout
from dit_train.models.layers import Attention
from dit_train.objectives.flow_matching import velocity_from_output
from dit_train.sampling.streaming import KVCache, cached_forward

log = logging.getLogger(__name__)


class FrozenHistory:
    """The attention callable of one layer while block b is differentiated: the keys and values
    of the local history tokens (`history` [L] bool) enter as constants. q, k, v [L, H, Dh],
    local tokens (before any CP exchange, so it holds for every CP scheme)."""

    def __init__(self, fn: Any, history: torch.Tensor):
        self.fn, self.history = fn, history[:, None, None]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        k = torch.where(self.history, k.detach(), k)
        v = torch.where(self.history, v.detach(), v)
        return self.fn(q, k, v, meta)


@contextlib.contextmanager
def frozen_history(model: torch.nn.Module, history: torch.Tensor) -> Iterator[None]:
    """Every self-attention layer of `model` treats the `history` tokens' K/V as constants."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    saved = [m.attention_fn for m in layers]
    try:
        for m, fn in zip(layers, saved):
            m.attention_fn = FrozenHistory(fn, history)
        yield
    finally:
        for m, fn in zip(layers, saved):
            m.attention_fn = fn


@dataclass
class Rollout:
    """One rollout of a micro-batch: x0 [L, D] every token's x̂0 (its block's exit), x_exit
    [L, D] its block's input at the exit step, t_exit [S, NB] each block's exit level."""

    x0: torch.Tensor
    x_exit: torch.Tensor
    t_exit: torch.Tensor


class SelfForcingTrainer(DistillTrainer):
    """DistillTrainer whose student sample is a Self-Forcing rollout (module docstring)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.told_recompute = False  # the CP layouts' one line about the recomputing rollout

    def scoring(self, mb: MicroBatch) -> MicroBatch:
        """The same local tokens under bidirectional attention (the teacher and the critic are
        bidirectional): the CP layout with its causal flag off, or a plain varlen layout."""
        b = mb.batch
        if isinstance(mb.attn, VarlenLayout):
            return MicroBatch(b, VarlenLayout.build(b.seg, b.order, False))
        return MicroBatch(b, replace(mb.attn, causal=False, cache={}))

    def block_times(self, b: Any, block: int, t: torch.Tensor) -> torch.Tensor:
        """[S, NB] each block's flow time while block `block` is denoised at t [S]: the history
        at 0 (clean), later blocks at 1 (noise; the mask keeps them out of earlier outputs)."""
        nb = self.task.max_blocks
        cols = torch.arange(nb, device=t.device)[None]
        return torch.where(cols < block, 0.0, torch.where(cols == block, t[:, None].float(), 1.0))

    def block_velocity(self, mb: MicroBatch, x: torch.Tensor, block_t: torch.Tensor, t_tok: torch.Tensor) -> torch.Tensor:
        """[L, D] the student's velocity at tokens x with each (sample, block) at block_t [S, NB]."""
        b = mb.batch
        with self.roles.use("student") as model:
            out = video_forward(model, replace(b, samples={**b.samples, "block_t": block_t}), mb.attn, x=x).float()
        return velocity_from_output(out, x, t_tok[:, 0], self.task.prediction, self.task.x0_min_t)

    def inputs(self, b: Any, block: int, x0: torch.Tensor, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """[L, D] the pack's input while `block` is denoised: history x̂0, the block at x, the rest noise."""
        blk = b.block[:, None]
        return torch.where(blk < block, x0, torch.where(blk == block, x, noise))

    def exit_tokens(self, b: Any, exits: torch.Tensor) -> torch.Tensor:
        """[L] the exit step of each token's (sample, block) from exits [S, NB] (padding: 0)."""
        rows = torch.cat([exits, exits.new_zeros(1, exits.shape[1])])
        return rows[b.seg, b.block.clamp(max=exits.shape[1] - 1)]

    @torch.no_grad()
    def generate(self, mb: MicroBatch, start: str, j: int) -> tuple[torch.Tensor, Rollout]:
        """The rollout of the micro-batch from its noise tokens[start] (module docstring): with the
        KV cache on a varlen (DP / one-process) layout, recomputed under context parallelism."""
        if isinstance(mb.attn, VarlenLayout):
            return self.rollout_cached(mb, start)
        if not self.told_recompute:  # once, from rank 0; a warning: the workers show no info lines
            self.told_recompute = True
            if self.ctx.is_main:
                log.warning("self_forcing: context parallelism splits a clip's blocks over ranks, which the KV cache does "
                            "not; the rollout recomputes the history at every step (NB*K forwards of the whole pack)")
        return self.rollout_recomputed(mb, start)

    def rollout_cached(self, mb: MicroBatch, start: str) -> tuple[torch.Tensor, Rollout]:
        """Block by block, each block's tokens over the student's K steps against the packed
        KVCache of the clips' finished blocks (clean x̂0 at t = 0), then committed to it."""
        b = mb.batch
        noise, sig = b.tokens[start].float(), b.samples["sigmas"]
        exits = b.samples["exit" if start == "x" else "exit_c"]  # [S, NB]
        exit_tok = self.exit_tokens(b, exits)
        x0, x_exit = torch.zeros_like(noise), noise.clone()
        nb, cache = self.task.max_blocks, KVCache(packed=True)
        with self.roles.use("student") as model:
            for block in range(nb):
                idx = ((b.seg >= 0) & (b.block == block)).nonzero()[:, 0]
                real = idx.numel() > 0
                # FSDP all-gathers in every forward: a rank without this block's tokens runs a
                # stand-in (its first token), its output dropped and never committed
                idx = idx if real else idx.new_zeros(1)
                sub, x, ex = b.select(idx), noise[idx], exit_tok[idx]
                for i in range(self.task.distill.student_steps):
                    t_tok = per_token(sig[:, i], sub.seg)
                    v = self.cached_velocity(model, sub, x, self.block_times(b, block, sig[:, i]), t_tok, cache)
                    take = (ex == i)[:, None] & real
                    x0[idx] = torch.where(take, x0_from_velocity(x, v, t_tok), x0[idx])
                    x_exit[idx] = torch.where(take, x, x_exit[idx])
                    x = x + (per_token(sig[:, i + 1], sub.seg, 0.0) - per_token(sig[:, i], sub.seg, 0.0)) * v
                if block < nb - 1:  # commit: the block's x̂0 at t = 0, the history of the later blocks
                    done = replace(sub, samples={**sub.samples, "block_t": self.block_times(b, block + 1, sig[:, 0])})
                    cached_forward(model, done, cache, x=x0[idx], record=real)
        return x0, Rollout(x0, x_exit, sig.gather(1, exits))

    def cached_velocity(self, model: Any, sub: Any, x: torch.Tensor, block_t: torch.Tensor, t_tok: torch.Tensor,
                        cache: KVCache) -> torch.Tensor:
        """[Lq, D] the student's velocity at the block's tokens x with each (sample, block) at block_t [S, NB]."""
        out = cached_forward(model, replace(sub, samples={**sub.samples, "block_t": block_t}), cache, x=x).float()
        return velocity_from_output(out, x, t_tok[:, 0], self.task.prediction, self.task.x0_min_t)

    def rollout_recomputed(self, mb: MicroBatch, start: str) -> tuple[torch.Tensor, Rollout]:
        """Every step of every block a forward of the whole pack under the block-causal mask:
        the history at x̂0 (t = 0), the block at x, later blocks noise (masked out)."""
        b = mb.batch
        noise, sig = b.tokens[start].float(), b.samples["sigmas"]
        exits = b.samples["exit" if start == "x" else "exit_c"]  # [S, NB]
        valid = b.seg >= 0
        exit_tok = self.exit_tokens(b, exits)
        x0, x_exit = torch.zeros_like(noise), noise.clone()
        for block in range(self.task.max_blocks):
            here = (valid & (b.block == block))[:, None]
            x = noise
            for i in range(self.task.distill.student_steps):
                t_tok = per_token(sig[:, i], b.seg)
                inp = self.inputs(b, block, x0, x, noise)
                v = self.block_velocity(mb, inp, self.block_times(b, block, sig[:, i]), t_tok)
                take = here & (exit_tok == i)[:, None]
                x0 = torch.where(take, x0_from_velocity(inp, v, t_tok), x0)
                x_exit = torch.where(take, inp, x_exit)
                x = inp + (per_token(sig[:, i + 1], b.seg, 0.0) - per_token(sig[:, i], b.seg, 0.0)) * v
        return x0, Rollout(x0, x_exit, sig.gather(1, exits))

    def trained_x0(self, mb: MicroBatch, state: Rollout, j: int) -> list[tuple[torch.Tensor | None, Any]]:
        """Block by block: x̂0_b recomputed with gradient from its exit input, the history's
        tokens and keys/values constants; the mask keeps the loss to block b's tokens."""
        b = mb.batch
        valid = b.seg >= 0
        exit_t = torch.cat([state.t_exit, state.t_exit.new_ones(1, state.t_exit.shape[1])])
        t_tok = exit_t[b.seg, b.block.clamp(max=exit_t.shape[1] - 1)][:, None]

        def block_x0(block: int) -> torch.Tensor:
            inp = self.inputs(b, block, state.x0, state.x_exit, state.x_exit)
            v = self.block_velocity(mb, inp, self.block_times(b, block, state.t_exit[:, block]), t_tok)
            return x0_from_velocity(inp, v, t_tok)

        student = self.roles.models["student"]
        return [((valid & (b.block == k)).float(), lambda k=k: block_x0(k),
                 lambda k=k: frozen_history(student, b.block < k)) for k in range(self.task.max_blocks)]
