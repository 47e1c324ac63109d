"""Tokens/s of a diffusers video family on our packed path vs diffusers' own forward on a padded
batch, forward + backward, at equal parameters (the same module, the same weights):

    python -m dit_train.tools.bench_families [--family ltx,hunyuan15] [--dim 256 --depth 4 --heads 4] [--reps 5] [--out FILE] [--quick]

Workload `mixed`: clips of several shapes (heavy-tailed lengths, as bench_wan's). diffusers'
transformer takes no self-attention mask, so a batch of different sizes must be zero-padded to
the largest clip (`padded`): every clip then costs the largest one's tokens. Ours packs the
clips into one sequence with per-clip (varlen) attention. Only the valid tokens count in
tokens/s. (The padded run's outputs are not even correct for the small clips — their tokens
attend to the padding — so this is a lower bound on what padding costs.)

Timing: median of interleaved repetitions (ours, padded, ours, ...) after one warm-up each, in
wall time and in CPU time of the process (robust to other load on a shared machine).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, init_weights, model_config, model_spec
from dit_train.perf.bench import (add_packed_vs_diffusers_args, format_table, interleaved_wall_and_cpu, median,
                                  packed_vs_diffusers_header, padded_batch, parse_packed_vs_diffusers_args, write_json)
from dit_train.tasks.joint_text import join_text_tokens, video_rows
from dit_train.tasks.video import pack_clips

TEXT_LEN = 16  # caption tokens per clip


@dataclass(frozen=True)
class Family:
    """How to build a tiny-to-mid config of the family and call diffusers' own model on a padded batch."""

    channels: int
    patch: tuple[int, int, int]
    config: Callable[[int, int, int, int], Any]  # (dim, depth, heads, text_dim) -> model config
    # (diffusers model, x [B, C, F, H, W], t [B] in [0, 1], text [B, Lt, text_dim], config) -> output
    padded_call: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
    # latent (frames, height, width) of the mixed workload (token counts as bench_wan's at patch 1x2x2)
    shapes: tuple[tuple[int, int, int], ...]
    quick_shapes: tuple[tuple[int, int, int], ...]


def _ltx_call(model: Any, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, cfg: Any) -> torch.Tensor:
    from diffusers import LTXPipeline  # deferred: diffusers takes ~2 s to import; only the LTX rows need it

    p = cfg.patch_size
    tokens = LTXPipeline._pack_latents(x, p[1], p[0])
    grid = [s // q for s, q in zip(x.shape[2:], p)]
    return model(tokens, text, t * 1000, torch.ones(text.shape[:2]), num_frames=grid[0], height=grid[1], width=grid[2],
                 rope_interpolation_scale=tuple(cfg.rope_scale), return_dict=False)[0]


def _hunyuan15_call(model: Any, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, cfg: Any) -> torch.Tensor:
    """HunyuanVideo15Pipeline's text-to-video call: zero conditioning channels, every caption token
    valid, no ByT5 tokens (mask 0), zero image embeddings."""
    B = x.shape[0]
    x = torch.cat([x, x.new_zeros(B, cfg.image_cond_channels, *x.shape[2:])], dim=1)
    return model(x, t * 1000, text, torch.ones(text.shape[:2], dtype=torch.long),
                 encoder_hidden_states_2=x.new_zeros(B, 1, cfg.text_2_dim),
                 encoder_attention_mask_2=torch.zeros(B, 1, dtype=torch.long),
                 image_embeds=x.new_zeros(B, 1, cfg.image_dim), return_dict=False)[0]


def _hunyuan15_config(dim: int, depth: int, heads: int, text_dim: int) -> Any:
    hd = dim // heads
    t_axis = 2 * (hd // 8)  # RoPE channels t | h | w summing to the head width (HunyuanVideo 1.5: 16 | 56 | 56 of 128)
    return model_config("hunyuan15", dim=dim, depth=depth, heads=heads, text_dim=text_dim, text_len=TEXT_LEN,
                        in_channels=32, image_cond_channels=33, text_2_dim=32, image_dim=32, patch_size=[1, 1, 1],
                        rope_axes=[t_axis, (hd - t_axis) // 2, (hd - t_axis) // 2], init="normal")


MIXED = ((2, 8, 8),) * 6 + ((4, 8, 12),) * 3 + ((8, 12, 12),) * 2 + ((12, 16, 16),)
QUICK = ((2, 4, 4),) * 2 + ((2, 4, 6), (4, 8, 8))

FAMILIES = {
    "ltx": Family(channels=128, patch=(1, 1, 1),
                  config=lambda dim, depth, heads, text_dim: model_config(
                      "ltx", dim=dim, depth=depth, heads=heads, text_dim=text_dim, text_len=TEXT_LEN, in_channels=128,
                      patch_size=[1, 1, 1], init="normal"),
                  padded_call=_ltx_call, shapes=MIXED, quick_shapes=QUICK),
    # joint text-video attention: ours puts each clip's caption tokens into the pack (tasks/joint_text.py)
    "hunyuan15": Family(channels=32, patch=(1, 1, 1), config=_hunyuan15_config, padded_call=_hunyuan15_call,
                        shapes=MIXED, quick_shapes=QUICK),
}


def packed_inputs(fam: Family, shapes, text_dim: int, seed: int = 0, joint_text: bool = False):
    """Our packed call's (arguments, keyword arguments) for `shapes` and a random target; with
    joint_text each clip's TEXT_LEN caption tokens follow it in the pack (zero target there)."""
    g = torch.Generator().manual_seed(seed)
    clips = [torch.randn(fam.channels, *shape, generator=g) for shape in shapes]
    S = len(shapes)
    batch = pack_clips({"x": clips}, fam.patch, fam.channels * math.prod(fam.patch), {}, torch.arange(S))
    if joint_text:
        batch = join_text_tokens(batch, torch.full((S,), TEXT_LEN))
    meta = VarlenLayout.build(batch.seg, batch.order, causal=False)
    x = batch.tokens["x"]
    args = (x, batch.pos, batch.seg, torch.rand(S, generator=g), meta,
            torch.randn(S, TEXT_LEN, text_dim, generator=g), torch.full((S,), TEXT_LEN))
    kwargs = {"text": batch.tokens["text"]} if joint_text else {}
    target = torch.randn(x.shape, generator=g) * video_rows(batch)[:, None]
    return args, kwargs, target


def padded_inputs(fam: Family, shapes, text_dim: int, seed: int = 0):
    """All clips in one batch, zero-padded to the largest (F, H, W)."""
    g = torch.Generator().manual_seed(seed)
    x = padded_batch([torch.randn(fam.channels, *s, generator=g) for s in shapes])
    return x, torch.rand(len(shapes), generator=g), torch.randn(len(shapes), TEXT_LEN, text_dim, generator=g)


def valid_tokens(fam: Family, shapes) -> int:
    return sum((f // fam.patch[0]) * (h // fam.patch[1]) * (w // fam.patch[2]) for f, h, w in shapes)


def bench(family: str, a: argparse.Namespace) -> dict:
    fam = FAMILIES[family]
    cfg = fam.config(a.dim, a.depth, a.heads, a.text_dim)
    ours = build_model(cfg, a.backend)
    init_weights(ours, 0, "normal")
    theirs = model_spec(cfg).to_diffusers(ours.state_dict(), cfg)  # the same weights in diffusers' module
    params = {"ours": sum(p.numel() for p in ours.parameters()), "diffusers": sum(p.numel() for p in theirs.parameters())}
    shapes = list(fam.quick_shapes if a.quick else fam.shapes)
    args, kwargs, target = packed_inputs(fam, shapes, a.text_dim, joint_text=model_spec(cfg).joint_text)
    x, t, text = padded_inputs(fam, shapes, a.text_dim)

    def run_ours():
        ours.zero_grad(set_to_none=True)
        ((ours(*args, **kwargs) - target) ** 2).mean().backward()

    def run_padded():
        theirs.zero_grad(set_to_none=True)
        out = fam.padded_call(theirs, x, t, text, cfg)
        (out ** 2).mean().backward()

    wall, cpu = interleaved_wall_and_cpu({"ours": run_ours, "padded": run_padded}, reps=a.reps)
    n = valid_tokens(fam, shapes)
    to, tp = median(wall["ours"]), median(wall["padded"])
    row = {"family": family, "clips": len(shapes), "valid_tokens": n, "padded_tokens": x.shape[0] * valid_tokens(fam, [x.shape[2:]]),
           "ours_tok_s": n / to, "padded_tok_s": n / tp, "speedup_vs_padded": tp / to,
           "cpu_time_speedup": median(cpu["padded"]) / median(cpu["ours"]), "ours_ms": to * 1e3, "padded_ms": tp * 1e3}
    return {"params": params, "row": row}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_train.tools.bench_families", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default=",".join(FAMILIES), help=f"comma list of: {', '.join(FAMILIES)}")
    add_packed_vs_diffusers_args(ap)
    a = parse_packed_vs_diffusers_args(ap, argv, quick=(64, 1, 2, 32))
    results = {f: bench(f, a) for f in a.family.split(",")}
    print(packed_vs_diffusers_header(a) + "; equal parameters (one module, two forwards)")
    print(format_table([r["row"] for r in results.values()]))
    p = write_json(a.out, "families", {"args": vars(a), "results": results})
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
