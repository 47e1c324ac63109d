"""Measure the mistake that the per-stream hierarchical mean avoids: per-micro-batch stream means.

One step of audio + video clips (video tokens by size and length, audio tokens by seconds of
sound, some clips without audio, some with only part of it) is placed on several layouts by the
project's own planner (`place`: data-parallel degree × micro-batch budget). For each clip it
prints the weight its audio and its video get (Σ of its tokens' a_t) under

  exact   a = λ_s·w / (B_s·T_{b,s})                       (dit_train, any layout)
  naive   a = λ_s·w / (n_{k,s}·M·W)   per micro-batch k: the sum over streams of each stream's
          token mean in the micro-batch (n_{k,s} = its tokens of stream s), averaged over the
          M micro-batches of a rank and the W ranks — what peers do (FastVideo PR #1688); a
          micro-batch without audio gives no audio gradient and nothing renormalises

and how far the naive weights move with the layout:

    python -m dit_train.tools.stream_shift --clips 16 --seed 0

Pure arithmetic on counts (no model, no processes): the exact weights come from `sync_counts`
and `token_weights` on one process, which tests/test_streams.py proves equal to the weights of
dp_shard=2 × cp_ulysses=2.
"""
from __future__ import annotations

import argparse
import sys

import torch

from dit_train.batch import STREAMS, PackedBatch
from dit_train.data_pipelines.packing import place
from dit_train.loss import sync_counts, token_weights
from dit_train.tools.args import POSITIVE_INT, ToolParser

VIDEO, AUDIO = STREAMS.index("video"), STREAMS.index("audio")
AUDIO_TOKENS_PER_SECOND = 25  # LTX-2's audio latents: 25 per second of sound
LAYOUTS = ((1, 100_000), (1, 1200), (2, 1200), (4, 800), (8, 600))  # (DP ranks, micro-batch token budget)


def make_clips(n: int, seed: int) -> dict[int, tuple[int, int]]:
    """{clip id: (video tokens, audio tokens)}: 1-4 s clips at 2 sizes; a third without audio,
    a sixth with sound for only part of the clip (a short track)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        seconds = int(torch.randint(1, 5, (), generator=g))
        spatial = (24, 60)[int(torch.randint(0, 2, (), generator=g))]
        video = seconds * 2 * spatial  # 2 latent frames a second
        u = float(torch.rand((), generator=g))
        audio = 0 if u < 1 / 3 else (AUDIO_TOKENS_PER_SECOND * seconds if u > 1 / 2 else AUDIO_TOKENS_PER_SECOND // 2)
        out[i] = (video, audio)
    return out


def pack(clips: dict[int, tuple[int, int]], ids: list[int]) -> PackedBatch:
    """One micro-batch: each clip's video tokens, then its audio tokens."""
    seg, stream = [], []
    for k, i in enumerate(ids):
        v, a = clips[i]
        seg += [k] * (v + a)
        stream += [VIDEO] * v + [AUDIO] * a
    seg_t = torch.tensor(seg, dtype=torch.long)
    return PackedBatch(seg=seg_t, pos=torch.zeros(len(seg), 1, dtype=torch.long), order=torch.zeros_like(seg_t),
                       valid=torch.ones(len(seg), dtype=torch.bool), stream=torch.tensor(stream, dtype=torch.long),
                       sample_ids=torch.tensor(ids, dtype=torch.long))


def micro_stream_mean_weights(b: PackedBatch, lambdas: tuple[float, ...], micro: int, world: int) -> torch.Tensor:
    """[L] the mistake: λ_s·w / (n_{k,s}·M·W), n_{k,s} = Σ w of stream s in this micro-batch."""
    w = b.loss_weight().double()
    out = torch.zeros_like(w)
    for s, lam in enumerate(lambdas):
        m = (b.stream == s) & (b.seg >= 0)
        n = float(w[m].sum())
        if n > 0:
            out[m] = lam * w[m] / (n * micro * world)
    return out


def clip_weights(per_rank: list[list[list[int]]], clips: dict[int, tuple[int, int]], lambdas: tuple[float, ...],
                 exact: bool) -> dict[tuple[int, int], float]:
    """{(clip, stream): Σ a over the clip's tokens of that stream} of one layout's packs."""
    batches = [(pack(clips, ids), len(packs)) for packs in per_rank for ids in packs]
    meta = sync_counts([b for b, _ in batches], None, None, streams=len(STREAMS))
    out: dict[tuple[int, int], float] = {}
    for k, (b, m) in enumerate(batches):
        if exact:
            a = token_weights("sample_mean", b.seg, b.loss_weight(), meta, k, stream=b.stream, lambdas=lambdas).double()
        else:
            a = micro_stream_mean_weights(b, lambdas, m, len(per_rank))
        keep = b.seg >= 0
        for sid, s, x in zip(b.sample_ids[b.seg[keep]].tolist(), b.stream[keep].tolist(), a[keep].tolist()):
            out[(sid, s)] = out.get((sid, s), 0.0) + x
    return out


def stream_shift(clips: dict[int, tuple[int, int]], lambdas: tuple[float, ...],
                 layouts=LAYOUTS) -> tuple[dict, dict[tuple[int, int], dict]]:
    """(exact weights of each layout, naive weights of each layout), keyed by (dp, budget)."""
    ids = sorted(clips)
    lengths = {i: sum(clips[i]) for i in ids}
    exact, naive = {}, {}
    for dp, budget in layouts:
        per_rank = place(ids, lengths, dp, 1, budget)
        exact[(dp, budget)] = clip_weights(per_rank, clips, lambdas, True)
        naive[(dp, budget)] = clip_weights(per_rank, clips, lambdas, False)
    return exact, naive


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.stream_shift", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clips", type=POSITIVE_INT, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--audio-weight", type=float, default=1.0, help="λ_audio (λ_video = 1)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    clips = make_clips(args.clips, args.seed)
    lambdas = (1.0, args.audio_weight)
    exact, naive = stream_shift(clips, lambdas)
    names = [f"dp{dp}/{budget if budget < 100_000 else 'all'}" for dp, budget in LAYOUTS]
    first = exact[LAYOUTS[0]]
    print("audio weight of each clip (Σ a over its audio tokens), exact vs per-micro-batch stream means:")
    print("| clip | video tokens | audio tokens | exact (every layout) | " + " | ".join(f"naive {n}" for n in names)
          + " | naive max/min over layouts |")
    print("|---" * (5 + len(names)) + "|")
    worst = 0.0
    for i, (v, a) in clips.items():
        if a == 0:
            continue
        row = [naive[lay].get((i, AUDIO), 0.0) for lay in LAYOUTS]
        ratio = max(row) / min(row)
        worst = max(worst, ratio)
        print(f"| {i} | {v} | {a} | {first[(i, AUDIO)]:.4f} | " + " | ".join(f"{x:.4f}" for x in row)
              + f" | {ratio:.2f} |")
    print(f"a clip's naive audio weight moves by up to {worst:.2f}x with the layout alone; the exact one by 0")
    for lay in LAYOUTS[1:]:  # the exact weights are the same on every layout (to rounding)
        assert all(abs(exact[lay][k] - first[k]) <= 1e-6 * abs(first[k]) for k in first)
    print()
    print("| layout | micro-batches | audio Σ (exact λ_a) | max/min audio weight over clips | worst audio shift | worst video shift |")
    print("|---|---|---|---|---|---|")
    ids = sorted(clips)
    for lay, name in zip(LAYOUTS, names):
        per_rank = place(ids, {i: sum(clips[i]) for i in ids}, lay[0], 1, lay[1])
        n = naive[lay]
        audio = [n.get((i, AUDIO), 0.0) for i in ids if clips[i][1]]
        shift = {s: max(abs(n.get((i, s), 0.0) - first[(i, s)]) / first[(i, s)] for i in ids if (i, s) in first)
                 for s in (VIDEO, AUDIO)}
        spread = max(audio) / min(audio) if min(audio) > 0 else float("inf")
        print(f"| {name} | {sum(len(p) for p in per_rank)} | {sum(audio):.3f} ({lambdas[AUDIO]:g}) | {spread:.2f} | "
              f"{shift[AUDIO]:.0%} | {shift[VIDEO]:.0%} |")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
