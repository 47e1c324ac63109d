"""Tokens/s of our packed VideoDiT vs diffusers' WanTransformer3DModel, forward + backward,
fp32 on the CPU, at (nearly) equal parameter counts and exactly equal tokens.

    python -m dit_train.tools.bench_wan [--dim 256 --depth 4 --heads 4] [--reps 5] [--out FILE] [--quick]

Parameters: Wan has cross-attention in every block and a shared modulation table; our DiT has
per-block adaLN linears. Two variants of ours, each against its own Wan whose `ffn_dim` is
solved so that the parameter counts match (reported, with the ratio):
  adaln       no caption cross-attention (text_dim 0). Caveat: adaLN weights are parameters
              that cost no per-token FLOPs (applied once per sample), so at equal parameters
              Wan gets a wider FFN plus cross-attention: ~20% more matmul FLOPs per token.
  adaln+text  with caption cross-attention to the same 16 caption tokens Wan attends to: the
              like-for-like architecture comparison.
Workloads (same clips for both models; 16-channel latents, patch (1, 2, 2)):
  uniform  B clips of one shape: Wan runs one [B, C, F, H, W] batch, ours one packed sequence.
  mixed    clips of several shapes (heavy-tailed lengths): Wan can take no mask, so it runs one
           batch per shape bucket (the best it can do without padding); ours packs them all
           into one sequence with per-sample (varlen) attention. `wan_padded`: Wan on one batch
           of all clips zero-padded to the largest shape (a dense model without bucketing).
Ours runs twice per repetition, with `model.recompute_prologues` on and off (the same model and
weights, switched between calls: models/recompute.py): `prologue_cost` is the time with them
on over the time with them off (> 1: recomputing the norms, modulate and GELU in backward
costs that much), `speedup` compares ours as configured by --prologues-default with Wan.
Timing: median of interleaved repetitions (ours on, ours off, Wan, ...) after one warm-up each,
in wall time and in CPU time of the process (robust to other load on a shared machine).
"""
from __future__ import annotations

import argparse

import torch

from dit_train.config.schema import ModelConfig
from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, init_weights, model_config
from dit_train.models.recompute import set_recompute_prologues
from dit_train.perf.bench import (add_packed_vs_diffusers_args, format_table, interleaved_wall_and_cpu, median,
                                  packed_vs_diffusers_header, padded_batch, parse_packed_vs_diffusers_args, write_json)
from dit_train.tasks.video import patchify

PATCH = (1, 2, 2)
C = 16


TEXT_LEN = 16  # caption tokens per clip, for Wan and for the text-conditioned variant of ours


def ours_model(dim: int, depth: int, heads: int, backend: str, text_dim: int = 0):
    cfg = model_config("dit", dim=dim, depth=depth, heads=heads, patch_size=list(PATCH), in_channels=C, init="normal",
                      text_dim=text_dim)
    m = build_model(cfg, backend)
    init_weights(m, 0, "normal")
    return m


def wan_model(dim: int, depth: int, heads: int, ffn_dim: int, text_dim: int):
    from diffusers import WanTransformer3DModel  # deferred: diffusers takes ~2 s to import; only the Wan rows need it

    return WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=dim // heads, in_channels=C,
                                 out_channels=C, text_dim=text_dim, freq_dim=256, ffn_dim=ffn_dim, num_layers=depth)


def nparams(m) -> int:
    return sum(p.numel() for p in m.parameters())


def matched_ffn(dim: int, depth: int, heads: int, text_dim: int, target: int) -> int:
    """Wan's params are affine in ffn_dim: solve for `target`, round to a multiple of 64."""
    with torch.device("meta"):
        p1 = nparams(wan_model(dim, depth, heads, 4 * dim, text_dim))
        p2 = nparams(wan_model(dim, depth, heads, 8 * dim, text_dim))
    slope = (p2 - p1) / (4 * dim)
    f = 4 * dim + (target - p1) / slope
    return max(64, int(round(f / 64)) * 64)


def clips(kind: str, quick: bool) -> list[tuple[int, int, int]]:
    """(frames, height, width) of latent clips."""
    if kind == "uniform":
        return [(4, 16, 16)] * (2 if quick else 8)
    if quick:  # the same mix of shapes, a fraction of the tokens (the script's own smoke test)
        return [(2, 8, 8)] * 2 + [(2, 8, 12), (4, 16, 16)]
    return [(2, 16, 16)] * 6 + [(4, 16, 24)] * 3 + [(8, 24, 24)] * 2 + [(12, 32, 32)]


def ours_inputs(shapes, text_dim: int = 0, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, pos, seg = [], [], []
    for i, (f, h, w) in enumerate(shapes):
        tok, grid = patchify(torch.randn(C, f, h, w, generator=g), PATCH)
        xs.append(tok)
        pos.append(grid)
        seg.append(torch.full((tok.shape[0],), i))
    seg_t = torch.cat(seg)
    order = torch.cat([torch.arange(len(s)) for s in seg])
    meta = VarlenLayout.build(seg_t, order, causal=False)
    x = torch.cat(xs)
    args = (x, torch.cat(pos), seg_t, torch.rand(len(shapes), generator=g), meta)
    if text_dim:
        S = len(shapes)
        args += (torch.randn(S, TEXT_LEN, text_dim, generator=g), torch.full((S,), TEXT_LEN))
    return args, torch.randn(x.shape, generator=g)


def wan_inputs(shapes, text_dim, text_len=TEXT_LEN, seed=0):
    """One batch per distinct shape."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for shape in sorted(set(shapes)):
        b = shapes.count(shape)
        x = torch.randn(b, C, *shape, generator=g)
        batches.append((x, torch.randint(0, 1000, (b,), generator=g), torch.randn(b, text_len, text_dim, generator=g),
                        torch.randn(x.shape, generator=g)))
    return batches


def wan_padded_input(shapes, text_dim, text_len=TEXT_LEN, seed=0):
    """All clips in one batch, zero-padded to the largest (F, H, W): a dense model without
    bucketing. Only the valid tokens count in tokens/s."""
    g = torch.Generator().manual_seed(seed)
    x = padded_batch([torch.randn(C, *s, generator=g) for s in shapes])
    b = len(shapes)
    return x, torch.randint(0, 1000, (b,), generator=g), torch.randn(b, text_len, text_dim, generator=g), torch.randn(x.shape, generator=g)


def tokens(shapes) -> int:
    return sum((f // PATCH[0]) * (h // PATCH[1]) * (w // PATCH[2]) for f, h, w in shapes)


def bench_variant(variant: str, a: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Parameter counts and rows (one per workload) of one variant of ours against its
    parameter-matched Wan."""
    if variant not in ("adaln", "adaln+text"):
        raise SystemExit(f"unknown variant {variant!r}: use adaln or adaln+text")
    ours_text = a.text_dim if variant == "adaln+text" else 0
    torch.manual_seed(0)
    ours = ours_model(a.dim, a.depth, a.heads, a.backend, ours_text)
    ffn = matched_ffn(a.dim, a.depth, a.heads, a.text_dim, nparams(ours))
    wan = wan_model(a.dim, a.depth, a.heads, ffn, a.text_dim)
    params = {"ours": nparams(ours), "wan": nparams(wan), "wan_ffn_dim": ffn}
    rows = []
    for kind in ("uniform", "mixed"):
        shapes = clips(kind, a.quick)
        o_args, o_tgt = ours_inputs(shapes, ours_text)
        w_batches = wan_inputs(shapes, a.text_dim)

        def run_ours(prologues: bool):
            def run():
                set_recompute_prologues(ours, prologues)
                ours.zero_grad(set_to_none=True)
                ((ours(*o_args) - o_tgt) ** 2).mean().backward()
            return run

        def run_wan():
            wan.zero_grad(set_to_none=True)
            for x, t, txt, tgt in w_batches:
                ((wan(x, t, txt, return_dict=False)[0] - tgt) ** 2).mean().backward()

        fns = {"ours_on": run_ours(True), "ours_off": run_ours(False), "wan": run_wan}
        if len(set(shapes)) > 1:
            padded = wan_padded_input(shapes, a.text_dim)

            def run_wan_padded():
                wan.zero_grad(set_to_none=True)
                x, t, txt, tgt = padded
                ((wan(x, t, txt, return_dict=False)[0] - tgt) ** 2).mean().backward()

            fns["wan_padded"] = run_wan_padded
        wall, cpu = interleaved_wall_and_cpu(fns, reps=a.reps, warmup=1)
        n = tokens(shapes)
        ours_key = "ours_on" if a.prologues_default == "on" else "ours_off"
        to, tw = median(wall[ours_key]), median(wall["wan"])
        t_on, t_off = median(wall["ours_on"]), median(wall["ours_off"])
        rows.append({"variant": variant, "workload": kind, "clips": len(shapes), "tokens": n,
                     "wan_batches": len(w_batches), "params_ratio": params["wan"] / params["ours"],
                     "prologues": a.prologues_default, "ours_tok_s": n / to, "wan_tok_s": n / tw, "speedup": tw / to,
                     "cpu_time_speedup": median(cpu["wan"]) / median(cpu[ours_key]),
                     "ours_ms": to * 1e3, "wan_ms": tw * 1e3, "ours_on_ms": t_on * 1e3, "ours_off_ms": t_off * 1e3,
                     "speedup_on": tw / t_on, "speedup_off": tw / t_off, "prologue_cost": t_on / t_off,
                     "prologue_cost_cpu": median(cpu["ours_on"]) / median(cpu["ours_off"])})
        if "wan_padded" in wall:
            tp = median(wall["wan_padded"])
            rows[-1].update(wan_padded_tok_s=n / tp, speedup_vs_padded=tp / to)
    return params, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_packed_vs_diffusers_args(ap)
    ap.add_argument("--variants", default="adaln,adaln+text", help="comma list of: adaln, adaln+text")
    ap.add_argument("--prologues-default", choices=("on", "off"), default="on" if ModelConfig.recompute_prologues else "off",
                    help="which of ours the speedup column compares with Wan (default: model.recompute_prologues' default)")
    a = parse_packed_vs_diffusers_args(ap, argv, quick=(64, 2, 2, 64))
    rows, params = [], {}
    for variant in a.variants.split(","):
        params[variant], variant_rows = bench_variant(variant, a)
        rows += variant_rows
    print(packed_vs_diffusers_header(a))
    print(format_table(rows))
    best = min(r["speedup"] for r in rows)
    print(f"smallest speedup {best:.2f}x (target >= 1.2x: {'met' if best >= 1.2 else 'NOT met'})")
    p = write_json(a.out, "wan", {"args": vars(a), "params": params, "rows": rows})
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
