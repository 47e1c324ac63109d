"""Tokens/s of our packed Wan 2.2 (PackedWan) vs diffusers' own WanTransformer3DModel holding the
very same weights (equal parameters, exactly), forward + backward, fp32 on the CPU.

    python -m dit_train.tools.bench_wan22 [--dim 256 --depth 4 --heads 4] [--reps 5] [--out FILE] [--quick]

One row per Wan 2.2 family, each at a reduced width/depth with the family's own structure:
  ti2v   TI2V-5B: 48-channel latents of the Wan 2.2 VAE, per-token timesteps (diffusers gets
         timestep [B, seq_len], as WanPipeline's expand_timesteps feeds it; ours the same
         per-token modulation)
  a14b   one A14B expert: 16-channel latents, one timestep per clip
Workload: the same heavy-tailed mix of clip shapes as tools.bench_wan (patch (1, 2, 2)), with
captions zero-padded to text_len as Wan is trained. Ours packs every clip into one sequence
(varlen attention); diffusers runs one batch per shape bucket (`bucketed`, the best it can do
without a mask) and one batch zero-padded to the largest shape (`padded`). Only valid tokens
count in tokens/s. Timing: median of interleaved repetitions after a warm-up, wall and CPU time
of the process (run it with `nice` on a shared machine and read the CPU-time column).
"""
from __future__ import annotations

import argparse
import sys

import torch

from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, init_weights, model_config
from dit_train.models.diffusers_family import to_diffusers
from dit_train.perf.bench import (add_packed_vs_diffusers_args, format_table, interleaved_wall_and_cpu, median,
                                  packed_vs_diffusers_header, padded_batch, parse_packed_vs_diffusers_args, write_json)
from dit_train.tasks.video import patchify

PATCH = (1, 2, 2)
TEXT_LEN = 16
FAMILIES = {"ti2v": 48, "a14b": 16}  # latent channels of the VAE each family trains on


def clips(quick: bool) -> list[tuple[int, int, int]]:
    """(frames, height, width) of latent clips (tools.bench_wan's mixed workload)."""
    if quick:
        return [(2, 8, 8)] * 2 + [(2, 8, 12), (4, 16, 16)]
    return [(2, 16, 16)] * 6 + [(4, 16, 24)] * 3 + [(8, 24, 24)] * 2 + [(12, 32, 32)]


def bench_family(family: str, a: argparse.Namespace) -> dict:
    C = FAMILIES[family]
    cfg = model_config("wan", dim=a.dim, depth=a.depth, heads=a.heads, ffn_dim=4 * a.dim, freq_dim=256, text_dim=a.text_dim,
                       text_len=TEXT_LEN, in_channels=C, patch_size=list(PATCH), init="normal")
    ours = build_model(cfg, a.backend)
    init_weights(ours, 0, "normal")
    wan = to_diffusers(ours.state_dict(), cfg)
    per_token = family == "ti2v"
    shapes = clips(a.quick)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(C, *s, generator=g) for s in shapes]
    t = torch.rand(len(shapes), generator=g)
    txt = torch.randn(len(shapes), TEXT_LEN, a.text_dim, generator=g)
    toks, pos, seg = zip(*[(*patchify(x, PATCH), torch.full((x[0].numel() // 4,), i)) for i, x in enumerate(xs)])
    seg_t = torch.cat(seg)
    meta = VarlenLayout.build(seg_t, torch.cat([torch.arange(len(s)) for s in seg]), causal=False)
    o_args = (torch.cat(toks), torch.cat(pos), seg_t, t, meta, txt, torch.full((len(shapes),), TEXT_LEN))
    o_tgt = torch.randn(o_args[0].shape, generator=g)

    def timesteps(idx: list[int], seq: int) -> torch.Tensor:
        ts = t[idx] * 1000
        return ts[:, None].expand(-1, seq).contiguous() if per_token else ts

    buckets = []
    for shape in sorted(set(shapes)):
        idx = [i for i, s in enumerate(shapes) if s == shape]
        seq = shape[0] * (shape[1] // 2) * (shape[2] // 2)
        x = torch.stack([xs[i] for i in idx])
        buckets.append((x, timesteps(idx, seq), txt[idx], torch.randn(x.shape, generator=g)))
    padded = padded_batch(xs)
    F, H, W = padded.shape[2:]
    pad_in = (padded, timesteps(list(range(len(shapes))), F * (H // 2) * (W // 2)), txt, torch.randn(padded.shape, generator=g))

    def run_ours():
        ours.zero_grad(set_to_none=True)
        ((ours(*o_args) - o_tgt) ** 2).mean().backward()

    def run_wan(batches):
        def run():
            wan.zero_grad(set_to_none=True)
            for x, ts, c, tgt in batches:
                ((wan(x, ts, c, return_dict=False)[0] - tgt) ** 2).mean().backward()
        return run

    wall, cpu = interleaved_wall_and_cpu({"ours": run_ours, "bucketed": run_wan(buckets), "padded": run_wan([pad_in])},
                                         reps=a.reps, warmup=1)
    n = int(seg_t.numel())
    to = median(wall["ours"])
    row = {"family": family, "params": sum(p.numel() for p in ours.parameters()),
           "params_equal": sum(p.numel() for p in wan.parameters()) == sum(p.numel() for p in ours.parameters()),
           "clips": len(shapes), "tokens": n, "ours_tok_s": n / to}
    for k in ("bucketed", "padded"):
        row[f"{k}_tok_s"] = n / median(wall[k])
        row[f"speedup_vs_{k}"] = median(wall[k]) / to
        row[f"cpu_speedup_vs_{k}"] = median(cpu[k]) / median(cpu["ours"])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="ti2v,a14b", help="comma list of: " + ", ".join(FAMILIES))
    add_packed_vs_diffusers_args(ap)
    a = parse_packed_vs_diffusers_args(ap, argv, quick=(64, 2, 2, 64))
    bad = [f for f in a.families.split(",") if f not in FAMILIES]
    if bad:
        print(f"error: --families {','.join(bad)}: use {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows = [bench_family(f, a) for f in a.families.split(",")]
    print(packed_vs_diffusers_header(a))
    print(format_table(rows))
    p = write_json(a.out, "wan22", {"args": vars(a), "rows": rows})
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
