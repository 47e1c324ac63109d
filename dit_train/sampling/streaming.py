"""Streaming generation for a block-causal run: block by block with a KV cache (docs/causal.md).

A block-causal model (model.causal_block_frames = K) lets a token see its own block and earlier
ones only, so a clip can be generated one block at a time: block j is denoised over the whole
time grid while attending to the keys and values of blocks 0..j−1, which never change once
those blocks are done. Those keys and values are cached per attention layer (`KVCache`) instead
of recomputed at every step: each step runs the model on block j's tokens alone.

Cache convention (CausVid / Self-Forcing's, not SkyReels-V2's): when block j is finished, one
more forward of its clean result x0_j at t = 0 records its K/V (`commit`); later blocks attend to
that clean context. The training it matches is diffusion forcing with clean history blocks
(loss.frame_noise=block, loss.history_prob > 0), where earlier blocks are given clean at t = 0.

Beyond the training length (`window_frames`, the run's data.max_frames): when the window is
full, the cache is cleared and the last `overlap_frames` generated frames are committed again at
positions 0.. (clean, t = 0), and generation goes on after them — the window slides as diffusers'
SkyReelsV2DiffusionForcingPipeline's `overlap_history` does (RoPE positions stay inside the
trained range).

The cache lives in the attention callable (`cached`), the way context parallelism swaps it in
(parallel/parallelize.py): the model code does not know about it. One process, one clip at a
time (a `packed` cache holds several clips of one pack, each token attending to its own clip:
Self-Forcing's rollout, distill/self_forcing.py): nothing here communicates.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dit_train.batch import video_forward
from dit_train.kernels import VarlenLayout
from dit_train.models.registry import attention_layers
from dit_train.objectives.flow_matching import velocity_from_output
from dit_train.rng import sample_generator
from dit_train.sampling.sampler import SampleRequest, VideoSampler
from dit_train.tasks.captions import pad_contexts
from dit_train.tasks.video import pack_clips, patchify, unpatchify


class KVCache:
    """Keys and values [Lc, H, Dh] (RoPE applied) of the committed tokens of one clip, per
    self-attention layer. `record`: the next forward appends its tokens' K/V (a commit).

    packed: the cache holds the committed tokens of several clips of one pack (Self-Forcing's
    rollout, distill/self_forcing.py); `seg` [Lc] is each cached token's sample and `query_seg`
    [Lq] the current forward's, so a token attends to its own clip's keys only."""

    def __init__(self, packed: bool = False) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.record = False
        # [Lq] causal block of each token of the current forward when it holds several blocks
        # (the asynchronous schedule); None = one block, which sees all of itself
        self.block: torch.Tensor | None = None
        self.packed = packed
        self.seg: torch.Tensor | None = None
        self.query_seg: torch.Tensor | None = None

    def clear(self) -> None:
        self.k.clear()
        self.v.clear()
        self.seg = None

    @property
    def tokens(self) -> int:
        return next(iter(self.k.values())).shape[0] if self.k else 0


class CachedAttention:
    """The attention callable of layer `layer` while a KVCache is in use: q, k, v [L, H, Dh] of
    the current block's tokens (one clip) attend to the cached keys then their own, unmasked (a
    block sees itself and everything before it: the block-causal rule, one block at a time).
    torch's scaled_dot_product_attention, its default scale 1/sqrt(Dh) as the layer's kernels."""

    def __init__(self, cache: KVCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        c = self.cache
        if self.layer in c.k:
            k, v = torch.cat([c.k[self.layer], k]), torch.cat([c.v[self.layer], v])
        if c.record:
            c.k[self.layer], c.v[self.layer] = k, v
        mask = None
        if c.block is not None:  # several blocks at once: cached keys all visible, the current ones block-causal
            mask = torch.cat([c.block.new_ones(len(c.block), k.shape[0] - len(c.block), dtype=torch.bool),
                              c.block[None, :] <= c.block[:, None]], dim=1)
        if c.packed:  # several clips: a query sees the cached and current keys of its own clip only
            keys = c.query_seg if c.seg is None else torch.cat([c.seg, c.query_seg])
            same = keys[None, :] == c.query_seg[:, None]
            mask = same if mask is None else mask & same
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask)
        return out[0].transpose(0, 1)


@contextlib.contextmanager
def cached(model: torch.nn.Module, cache: KVCache) -> Iterator[None]:
    """Every self-attention layer of `model` reads and writes `cache` inside the block: the modules
    holding an `attention_fn` (our DiT's, a diffusers family's self-attention: SkyReels-V2's)."""
    layers = attention_layers(model)
    saved = [m.attention_fn for m in layers]
    try:
        for i, m in enumerate(layers):
            m.attention_fn = CachedAttention(cache, i)
        yield
    finally:
        for m, fn in zip(layers, saved):
            m.attention_fn = fn


def block_forward(model: torch.nn.Module, x: torch.Tensor, start: int, t: float | list[float], cache: KVCache,
                  patch: tuple[int, int, int], context: torch.Tensor | None = None, record: bool = False) -> torch.Tensor:
    """The model's output [T, C·pt·ph·pw] for one block x [C, K, H, W] of one clip whose first
    temporal patch sits at `start` (RoPE position), at flow time t, attending to `cache` (and,
    with `record`, appending this block's K/V to it). context: [Lt, text_dim] the clip's caption.
    t a list (the asynchronous schedule): x holds len(t) blocks, block b at t[b] (the model's
    per-block timesteps, as diffusion forcing trains them), block-causal among themselves."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    blocks = len(t) if isinstance(t, list) else 0
    samples = {"block_t": torch.tensor([t], dtype=dtype)} if blocks else {"t": torch.tensor([t], dtype=dtype)}
    if context is not None:
        samples["context"], samples["context_len"] = pad_contexts([context], context.shape[-1])
    dim = x.shape[0] * math.prod(patch)
    b = pack_clips({"x": [x]}, patch, dim, samples, torch.zeros(1, dtype=torch.long),
                   causal_block=x.shape[1] // patch[0] // blocks if blocks else 0)
    b.pos[:, 0] += start
    b = b.to(next(model.parameters()).device)
    cache.block = b.block if blocks > 1 else None
    return cached_forward(model, b, cache, record=record)


def cached_forward(model: torch.nn.Module, b: Any, cache: KVCache, x: torch.Tensor | None = None,
                   record: bool = False) -> torch.Tensor:
    """The model's output [Lq, out] for the pack b's Lq tokens (x [Lq, in] in place of its own),
    attending to `cache` and, with `record`, appending their K/V (and, packed, their samples) to
    it. Each clip's tokens in b are its current block (or, with cache.block, its blocks in
    progress). One process: nothing communicates here."""
    meta = VarlenLayout.build(b.seg, b.mask_order, b.causal)  # unused by CachedAttention; the layers take one
    cache.record, cache.query_seg = record, b.seg
    try:
        with cached(model, cache):
            out = video_forward(model, b, meta, x=x)
    finally:
        cache.record, cache.block, cache.query_seg = False, None, None
    if record and cache.packed:  # after every layer appended its K/V: the samples of the new keys
        cache.seg = b.seg if cache.seg is None else torch.cat([cache.seg, b.seg])
    return out


class StreamingSampler(VideoSampler):
    """VideoSampler's requests generated block by block with a KV cache (module docstring).

    block_frames: K (frames per causal block); every request's frame count must be a multiple.
    window_frames: the longest clip the model saw (0 = no limit); overlap_frames: frames carried
    into the next window when a clip is longer (a multiple of K, less than the window).
    Each request starts from the same noise as VideoSampler's (its "sampling" stream), block j
    taking that noise's frames of block j, and every block runs the same time grid.
    The stochastic step draws block j's step i noise from the clip's "sampling" stream at step
    j·steps + i + 1. Unsupported here (refused by tools.sample before anything is built):
    conditioning feeds, control videos, latent-cache runs, context parallelism.
    """

    def __init__(self, *args: Any, block_frames: int, window_frames: int = 0, overlap_frames: int = 0, ar_step: int = 0,
                 **kw: Any):
        super().__init__(*args, **kw)
        self.block_frames, self.window_frames, self.overlap_frames = block_frames, window_frames, overlap_frames
        self.ar_step = ar_step  # 0: block by block (synchronous); N > 0: SkyReels-V2's staggered schedule

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, autocast: Callable[[], Any] | None = None,
               progress: bool = False) -> list[torch.Tensor]:
        autocast = autocast or contextlib.nullcontext
        xs, cfg, ctxs = self._start()
        was_training = model.training
        model.eval()
        out = []
        for k, x in enumerate(xs):
            contexts = [None] if ctxs is None else [ctxs[k]] + ([ctxs[len(xs) + k]] if cfg else [])
            with autocast():
                stream = self._stream_async if self.ar_step else self._stream
                out.append(stream(model, k, x, contexts, progress))
        model.train(was_training)
        return out

    def _stream(self, model: torch.nn.Module, k: int, noise: torch.Tensor, contexts: list, progress: bool) -> torch.Tensor:
        """Request k: its blocks in order; contexts: [caption] or [caption, null caption] (CFG),
        each branch with its own cache (their hidden states differ, so do their K/V)."""
        K, pt = self.block_frames, self.patch[0]
        caches = [KVCache() for _ in contexts]
        window = self.window_frames // K if self.window_frames else 0
        done: list[torch.Tensor] = []
        position = 0  # blocks in the current window
        blocks = noise.shape[1] // K
        for j in tqdm(range(blocks), desc=f"streaming clip {k}", unit="block", disable=not progress):
            if window and position == window:  # slide: the last overlap frames open the next window
                keep = self.overlap_frames // K
                for cache in caches:
                    cache.clear()
                for i, x0 in enumerate(done[len(done) - keep:]):
                    self._commit(model, x0, i * K // pt, caches, contexts)
                position = keep
            x = noise[:, j * K:(j + 1) * K]
            sched = self.schedulers()[k]  # a fresh one per block: every block runs the whole grid
            for i, t in enumerate(sched.sigmas[:-1].tolist()):
                v = self._velocity(model, x, position * K // pt, t, caches, contexts, k)
                # the stochastic step's noise: the clip's "sampling" stream, step j·steps + i + 1 (0 drew the start)
                gen = (sample_generator(self.seed, self.requests[k].noise_id, j * self.steps + i + 1, "sampling")
                       if self.stochastic else None)
                x = sched.step(v, sched.timesteps[i], x, generator=gen).prev_sample
            done.append(x)
            self._commit(model, x, position * K // pt, caches, contexts)
            position += 1
        return torch.cat(done, dim=1)

    def _stream_async(self, model: torch.nn.Module, k: int, noise: torch.Tensor, contexts: list,
                      progress: bool) -> torch.Tensor:
        """Request k under the asynchronous schedule, window by window: each window's new blocks
        run `ar_schedule` (`_window_async`) over the cache of its opening blocks — the last
        overlap_frames of the previous window, committed again clean at positions 0.. as the
        synchronous stream slides (`_stream`) — and the next window starts when this one is done,
        as SkyReels-V2's pipeline runs its overlap_history windows one after the other."""
        K, pt = self.block_frames, self.patch[0]
        caches = [KVCache() for _ in contexts]
        n = noise.shape[1] // K
        window = self.window_frames // K if self.window_frames else n
        keep = self.overlap_frames // K
        done: list[torch.Tensor] = []
        while len(done) < n:
            opening = done[len(done) - keep:] if done else []
            for cache in caches:
                cache.clear()
            for i, x0 in enumerate(opening):  # the overlap: clean context of the new window
                self._commit(model, x0, i * K // pt, caches, contexts)
            count = min(window - len(opening), n - len(done))
            done += self._window_async(model, k, noise, len(done), count, len(opening), caches, contexts, progress)
        return torch.cat(done, dim=1)

    def _window_async(self, model: torch.nn.Module, k: int, noise: torch.Tensor, first: int, count: int, offset: int,
                      caches: list[KVCache], contexts: list, progress: bool) -> list[torch.Tensor]:
        """Blocks first .. first + count − 1 of request k (their noise, their stochastic draws at
        their clip-wide block index), placed after `offset` cached blocks of the window: at each
        iteration of `ar_schedule` the blocks in progress run in one forward, each at its own
        level (block b ar_step steps behind block b − 1, attending to the earlier ones still
        noisy, as SkyReels-V2's pipeline); a block is committed to the cache clean (t = 0) once it
        is done and no longer in the forward."""
        K, pt = self.block_frames, self.patch[0]
        xs = [noise[:, (first + j) * K:(first + j + 1) * K] for j in range(count)]
        scheds = [self.schedulers()[k] for _ in range(count)]  # a fresh one per block: every block runs the whole grid
        committed = 0
        for row in tqdm(ar_schedule(count, self.steps, self.ar_step), desc=f"streaming clip {k}", unit="step",
                        disable=not progress):
            active = [b for b in range(count) if 1 <= row[b] <= self.steps]
            if not active:
                continue
            for j in range(committed, active[0]):  # done and out of the forward: into the cache, clean
                self._commit(model, xs[j], (offset + j) * K // pt, caches, contexts)
            committed = active[0]
            lo, hi = active[0], active[-1] + 1
            ts = [scheds[b].sigmas[row[b] - 1].item() for b in range(lo, hi)]
            vs = self._velocities(model, torch.cat(xs[lo:hi], dim=1), (offset + lo) * K // pt, ts, caches, contexts)
            for b, v in zip(range(lo, hi), vs):
                i = row[b] - 1
                gen = (sample_generator(self.seed, self.requests[k].noise_id, (first + b) * self.steps + i + 1,
                                        "sampling") if self.stochastic else None)
                xs[b] = scheds[b].step(v, scheds[b].timesteps[i], xs[b], generator=gen).prev_sample
        return xs

    def _velocities(self, model, x: torch.Tensor, start: int, ts: list[float], caches: list[KVCache],
                    contexts: list) -> list[torch.Tensor]:
        """The (guided) velocity [C, K, H, W] of each of the len(ts) blocks of x, block b at ts[b]."""
        n, grid = len(ts), self._grid(x.shape)
        per = grid[0] // n * grid[1] * grid[2]  # tokens per block (patchify's order: frames outermost)
        t_tok = torch.tensor(ts).repeat_interleave(per)
        vs = []
        for cache, ctx in zip(caches, contexts):
            out = block_forward(model, x, start, ts, cache, self.patch, ctx).float().cpu()
            vs.append(velocity_from_output(out, patchify(x, self.patch)[0], t_tok, self.prediction, self.x0_min_t))
        out = []
        for b, t in enumerate(ts):
            part = [v[b * per:(b + 1) * per] for v in vs]
            v = part[0] if len(part) == 1 else part[1] + self.guidance_at(t) * (part[0] - part[1])
            out.append(unpatchify(v, (grid[0] // n, *grid[1:]), self.patch, x.shape[0]).to(x.dtype))
        return out

    def _commit(self, model, x0: torch.Tensor, start: int, caches: list[KVCache], contexts: list) -> None:
        """Record a finished block's clean K/V (t = 0) in every branch's cache."""
        for cache, ctx in zip(caches, contexts):
            block_forward(model, x0, start, 0.0, cache, self.patch, ctx, record=True)

    def _velocity(self, model, x: torch.Tensor, start: int, t: float, caches: list[KVCache], contexts: list,
                  k: int) -> torch.Tensor:
        """The (guided) velocity [C, K, H, W] of block x at flow time t."""
        grid = self._grid(x.shape)
        vs = []
        for cache, ctx in zip(caches, contexts):
            out = block_forward(model, x, start, t, cache, self.patch, ctx).float().cpu()
            vs.append(velocity_from_output(out, patchify(x, self.patch)[0], t, self.prediction, self.x0_min_t))
        v = vs[0] if len(vs) == 1 else vs[1] + self.guidance_at(t) * (vs[0] - vs[1])
        return unpatchify(v, grid, self.patch, x.shape[0]).to(x.dtype)


def ar_schedule(blocks: int, steps: int, ar_step: int) -> list[list[int]]:
    """SkyReels-V2's asynchronous schedule (diffusers' SkyReelsV2DiffusionForcingPipeline
    .generate_timestep_matrix, one window, nothing pre-denoised): one row per model iteration, each
    block's step counter: 0 = not started, k in 1..steps = the block takes its k-th denoising step
    (at the grid's level k − 1) in this iteration, steps + 1 = done. Block b's counter at iteration
    i is i + 1 − b·ar_step, clamped: each block ar_step steps behind the one before it."""
    rows, i = [], 0
    while True:
        row = [min(max(i + 1 - b * ar_step, 0), steps + 1) for b in range(blocks)]
        if all(c > steps for c in row):
            return rows
        rows.append(row)
        i += 1


def stream_check(request_frames: int, block_frames: int, window_frames: int, overlap_frames: int) -> str | None:
    """Why `request_frames` cannot be streamed in blocks of `block_frames` (None when it can)."""
    K = block_frames
    if request_frames % K:
        return (f"--frames {request_frames} is not a multiple of the run's causal block (model.causal_block_frames={K}): "
                f"use {max(K, request_frames - request_frames % K)} or {request_frames - request_frames % K + K}")
    if overlap_frames % K or overlap_frames < 0:
        return f"--overlap-frames {overlap_frames} must be a multiple of model.causal_block_frames={K}"
    if window_frames and overlap_frames >= window_frames:
        return f"--overlap-frames {overlap_frames} must be less than the run's training length ({window_frames} frames)"
    if window_frames and request_frames > window_frames and not overlap_frames:
        return (f"--frames {request_frames} is longer than the run's training length ({window_frames} frames): give "
                f"--overlap-frames (e.g. {window_frames // 2 - window_frames // 2 % K or K}) to slide the window")
    return None


__all__ = ["KVCache", "StreamingSampler", "ar_schedule", "block_forward", "cached", "cached_forward", "stream_check"]
