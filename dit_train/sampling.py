"""Validation videos: a flow-matching Euler sampler over packed clips, CP-aware.

Every `train.sample_every` steps all ranks run the same sampling (FSDP needs every shard
holder in each forward, and under CP each rank computes its share of the tokens); rank 0
decodes and writes `samples/step_XXXXXX/` in the run dir: one mp4 per clip, a PNG grid
(rows = clips, columns = frames), the raw float samples (`samples.safetensors`) and the grid
in TensorBoard.

What is sampled is fixed for the whole run: the first `train.num_samples` readable clips of the
dataset give each sample's shape and caption; its starting noise comes from the "sampling"
random stream of (seed, sample id), so successive validations are comparable and any layout
produces the same videos. The time grid and the Euler update are diffusers'
`FlowMatchEulerDiscreteScheduler` (sigma = our t, timestep = 1000·t, x ← x + (σ' − σ)·v).
With `train.guidance_scale` > 1 and captions, each clip is packed twice — with its caption and
with the empty caption — and v = v_uncond + g·(v_cond − v_uncond) (classifier-free guidance).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from dit_train.batch import PackedBatch
from dit_train.parallel.context_parallel import split_for_cp
from dit_train.parallel.mesh import ParallelContext
from dit_train.rng import sample_generator
from dit_train.tasks.captions import pad_contexts
from dit_train.tasks.video import model_context, pack_clips, unpatchify
from kernels import VarlenLayout

log = logging.getLogger(__name__)


def _pack(xs: list[torch.Tensor], ts: list[float], ctxs: list[torch.Tensor] | None, patch, text_dim: int) -> PackedBatch:
    """Clips [C, F, H, W] at times ts -> one bidirectional pack (tokens of clip k have seg k)."""
    samples = {"t": torch.tensor(ts, dtype=torch.float32)}
    if ctxs is not None:
        samples["context"], samples["context_len"] = pad_contexts(ctxs, text_dim)
    patch_dim = xs[0].shape[0] * patch[0] * patch[1] * patch[2]
    return pack_clips({"x": xs}, patch, patch_dim, samples, torch.arange(len(xs)))


@torch.no_grad()
def predict_velocity(model: torch.nn.Module, batch: PackedBatch, ctx: ParallelContext) -> torch.Tensor:
    """The model's output for every token of a full pack: [L, patch_dim] on every rank.

    Under CP each rank runs its share of the pack (the same split as training) and the shares
    are all-gathered over the CP group (`ctx.cp_group`) to rebuild the whole pack. This is
    evaluation, not the loss path, so the collective lives here.
    """
    L = batch.num_tokens
    cp = ctx.dims.cp
    if cp > 1:
        local, meta = split_for_cp(batch, cp, ctx.cp_rank, "contiguous")
        meta = meta.to(ctx.device)
        local = local.to(ctx.device)
        out = model(local.tokens["x"], local.pos, local.seg, local.samples["t"], meta, **model_context(local)).float()
        shares = [torch.empty_like(out) for _ in range(cp)]
        dist.all_gather(shares, out.contiguous(), group=ctx.cp_group)
        full = torch.empty((meta.seg.numel(), out.shape[-1]), dtype=out.dtype, device=out.device)
        for c in range(cp):
            full[meta.index[c]] = shares[c]
        return full[:L]
    b = batch.to(ctx.device)
    meta = VarlenLayout.build(b.seg, b.order, False)
    return model(b.tokens["x"], b.pos, b.seg, b.samples["t"], meta, **model_context(b)).float()


class VideoSampler:
    """Generates the same `num_samples` clips at every call (see the module docstring).

    task: the training VideoTask (shapes, captions, patch size). decode: latents [C, f, h, w]
    -> pixels [3, F, H, W] in [-1, 1] (identity for pixel data).
    """

    def __init__(self, task: Any, ctx: ParallelContext, num_samples: int, steps: int, guidance_scale: float,
                 seed: int, decode: Callable[[torch.Tensor], torch.Tensor] | None = None, fps: int = 8):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.task, self.ctx, self.steps, self.guidance, self.seed = task, ctx, steps, guidance_scale, seed
        self.decode = decode or (lambda x: x)
        self.fps = fps
        self.scheduler_cls = FlowMatchEulerDiscreteScheduler
        self.items: list[tuple[int, torch.Size, torch.Tensor | None]] = []  # (sample id, shape, caption emb)
        for sid in range(len(task.dataset)):
            if len(self.items) == num_samples:
                break
            try:
                item = task.dataset[sid]
            except Exception as err:  # noqa: BLE001 - an unreadable clip is skipped here as in training
                log.warning("validation: skipping sample %d (%s)", sid, err)
                continue
            emb = task.caption_embedding(item) if task.text_dim else None
            self.items.append((sid, item.pixels.shape, emb))

    def sample(self, model: torch.nn.Module, autocast=None) -> list[torch.Tensor]:
        """Run the sampler; returns the clips [C, F, H, W] (model space: pixels or latents)."""
        import contextlib

        autocast = autocast or contextlib.nullcontext
        xs = [torch.randn(shape, generator=sample_generator(self.seed, sid, 0, "sampling")) for sid, shape, _ in self.items]
        cfg = self.guidance > 1.0 and self.task.text_dim > 0
        ctxs = None
        if self.task.text_dim:
            ctxs = [emb for _, _, emb in self.items]
            if cfg:
                ctxs = ctxs + [self.task.null_caption()] * len(ctxs)
        # one scheduler per clip: diffusers' schedulers keep a step counter per trajectory
        scheds = [self.scheduler_cls(num_train_timesteps=1000, shift=1.0) for _ in xs]
        for s in scheds:
            s.set_timesteps(self.steps)
        sigmas = scheds[0].sigmas.tolist()  # decreasing from 1 to 0, steps + 1 values
        was_training = model.training
        model.eval()
        n = len(xs)
        sizes = [math.prod(self._grid(x.shape)) for x in xs]
        offsets = np.cumsum([0] + (sizes + sizes if cfg else sizes)).tolist()
        for i, timestep in enumerate(scheds[0].timesteps):
            inputs = xs + xs if cfg else xs
            batch = _pack(inputs, [sigmas[i]] * len(inputs), ctxs, self.task.patch, self.task.text_dim)
            with autocast():
                v = predict_velocity(model, batch, self.ctx).cpu()
            for k in range(n):
                vk = v[offsets[k]:offsets[k + 1]]
                if cfg:
                    vu = v[offsets[n + k]:offsets[n + k + 1]]
                    vk = vu + self.guidance * (vk - vu)
                vel = unpatchify(vk, self._grid(xs[k].shape), self.task.patch, xs[k].shape[0])
                xs[k] = scheds[k].step(vel, timestep, xs[k]).prev_sample  # x + (σ_next − σ)·v
        model.train(was_training)
        return xs

    def _grid(self, shape: torch.Size) -> tuple[int, int, int]:
        pt, ph, pw = self.task.patch
        return shape[1] // pt, shape[2] // ph, shape[3] // pw

    def write(self, clips: list[torch.Tensor], out_dir: Path, tb: Any = None, step: int = 0,
              info: dict | None = None) -> Path:
        """Decode, then write mp4s, a PNG grid, the raw floats, info.json and (optionally) a
        TensorBoard image."""
        import json

        from safetensors.torch import save_file

        from data_pipelines.synthetic_video import write_mp4

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "info.json").write_text(json.dumps(info or {}, indent=2))
        save_file({f"sample_{sid}": c.contiguous() for (sid, _, _), c in zip(self.items, clips)},
                  str(out_dir / "samples.safetensors"))
        rows = []
        for (sid, _, _), clip in zip(self.items, clips):
            pixels = self.decode(clip).float().clamp(-1, 1)  # [3, F, H, W]
            frames = ((pixels + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()  # [F, H, W, 3]
            write_mp4(out_dir / f"sample_{sid}.mp4", _even(frames), fps=self.fps)
            rows.append(frames)
        grid = frame_grid(rows)
        from PIL import Image

        Image.fromarray(grid).save(out_dir / "grid.png")
        if tb is not None:
            tb.add_image("samples/grid", grid, step, dataformats="HWC")
        return out_dir


def _even(frames: np.ndarray) -> np.ndarray:
    """H.264 with yuv420p wants even sizes: pad odd ones by one edge row/column."""
    F, H, W, _ = frames.shape
    return np.pad(frames, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)), mode="edge")


def frame_grid(clips: list[np.ndarray], max_cols: int = 8, gap: int = 2) -> np.ndarray:
    """uint8 [F_i, H_i, W_i, 3] clips -> one image, a row per clip, up to max_cols frames each."""
    cells = [[c[j] for j in np.linspace(0, len(c) - 1, min(max_cols, len(c))).round().astype(int)] for c in clips]
    ch = max(f.shape[0] for row in cells for f in row)
    cw = max(f.shape[1] for row in cells for f in row)
    cols = max(len(r) for r in cells)
    img = np.full((len(cells) * (ch + gap) + gap, cols * (cw + gap) + gap, 3), 255, dtype=np.uint8)
    for i, row in enumerate(cells):
        for j, f in enumerate(row):
            y, x = gap + i * (ch + gap), gap + j * (cw + gap)
            img[y:y + f.shape[0], x:x + f.shape[1]] = f
    return img
