"""MFU of the packed DiT on one GPU, and activation memory per rank vs context-parallel degree.

    # one GPU (H100): ~1.5B DiT, bf16 autocast, 8k and 32k tokens, AC off/on, compile off/on
    python -m dit_train.tools.bench_mfu --model dit_1b --tokens 8192,32768 --ac none,selective,full --compile off,on --backend flash,xformers,sdpa
    # CP activation memory vs degree (needs that many GPUs; gloo + CPU works for tiny models)
    python -m dit_train.tools.bench_mfu --model dit_1b --cp-memory 1,2,4,8 --tokens 32768
    # the same on 2 CPU processes (gloo), with model.recompute_prologues off and on (any mode: --prologues)
    python -m dit_train.tools.bench_mfu --model dit_small --device cpu --cp-memory 1,2,4 --tokens 2048 --sample-tokens 1024 \
        --precision fp32 --prologues off,on
    # CPU dry run (what the tests run)
    python -m dit_train.tools.bench_mfu --model dit_tiny --device cpu --tokens 512 --steps 2 --precision fp32

FLOPs (dit_train/perf/flops.py): 6·N_tok·ΣT_b + 12·d·depth·ΣT_b² per step (model FLOPs;
activation-checkpointing recompute not counted). MFU = FLOPs / (step time · peak); peak
defaults to 989 TFLOP/s (H100 SXM dense bf16) on CUDA; on CPU give --peak-tflops or read the
achieved TFLOP/s. Each pack holds `tokens / sample_tokens` samples of `--sample-tokens`
(default: one sample per pack). The estimate of `dit_train.perf.memory` is printed next to
the measured `torch.cuda.max_memory_allocated`.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from dataclasses import replace

import torch

from dit_train.batch import PackedBatch, video_forward
from dit_train.compose import compose
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.engine.build import build_parallel_model
from dit_train.kernels import resolve_backend, VarlenLayout
from dit_train.models import build_model, model_spec
from dit_train.parallel.context_parallel import split_for_cp
from dit_train.parallel.mesh import init_parallel
from dit_train.parallel.checkpointing import ac_policy
from dit_train.parallel.parallelize import apply_activation_checkpointing, apply_compile
from dit_train.perf.bench import format_table, write_json
from dit_train.perf.flops import mfu, train_flops
from dit_train.perf.memory import GIB, RankSetup, estimate_memory, model_shape, saved_activation_bytes


def model_cfg(name: str):
    """The model node of conf/model/<name>.yaml."""
    return compose([f"model={name}"]).model


def make_pack(cfg, tokens: int, sample_tokens: int, device, seed: int = 0):
    """A packed micro-batch of `tokens` tokens made of samples of `sample_tokens` tokens."""
    lens = [sample_tokens] * (tokens // sample_tokens) + ([tokens % sample_tokens] if tokens % sample_tokens else [])
    return pack_of_lengths(cfg, lens, seed), lens


def pack_of_lengths(cfg, lens: list[int], seed: int = 0) -> PackedBatch:
    """A packed micro-batch of random clips with `lens` tokens each (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    pd = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    tokens = sum(lens)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    order = torch.cat([torch.arange(n) for n in lens])
    side = 64  # (t, h, w) coordinates of a 64x64-token frame grid
    pos = torch.stack([order // (side * side), (order // side) % side, order % side], dim=-1)
    batch = PackedBatch(seg=seg, pos=pos, order=order, valid=torch.ones_like(seg, dtype=torch.bool),
                        tokens={"x": torch.randn(tokens, pd, generator=g), "target": torch.randn(tokens, pd, generator=g)},
                        samples={"t": torch.rand(len(lens), generator=g)}, sample_ids=torch.arange(len(lens)))
    if cfg.text_dim:  # text-conditioned model: full-length captions for every clip
        batch.samples["context"] = torch.randn(len(lens), cfg.text_len, cfg.text_dim, generator=g)
        batch.samples["context_len"] = torch.full((len(lens),), cfg.text_len, dtype=torch.long)
    return batch


def run_single(cfg, tokens, sample_tokens, ac, compile_, backend, precision, device, steps, peak):
    backend = resolve_backend(backend, device)
    with torch.device(device):  # built and drawn where it runs: a 1B model's CPU init costs seconds a row
        model = build_model(cfg, backend)
        for p in model.parameters():  # a speed benchmark: the values need only be finite and non-degenerate
            torch.nn.init.normal_(p, std=0.02)
    ac = ac_policy(ac)  # a policy name (none | selective | full) or a bool alias
    apply_activation_checkpointing(model_spec(cfg).blocks(model), ac)
    if compile_:
        apply_compile(model_spec(cfg).blocks(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch, lens = make_pack(cfg, tokens, sample_tokens, device)
    batch = batch.to(device)
    meta = VarlenLayout.build(batch.seg, batch.order, False)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else torch.autocast(device.type, enabled=False)
    cuda = device.type == "cuda"
    times = []
    for step in range(steps):
        if cuda:
            torch.cuda.synchronize()
            if step == 1:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with amp:
            pred = video_forward(model, batch, meta)
            loss = ((pred.float() - batch.tokens["target"]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    shape = model_shape(cfg)
    flops = train_flops(shape, lens)
    t = statistics.median(times[1:]) if steps > 1 else times[0]
    est = estimate_memory(shape, RankSetup(micro_batch_tokens=tokens, checkpointing=ac, precision=precision,
                                           backend=backend, dp_mode="none"))
    row = {"tokens": tokens, "samples": len(lens), "ac": ac, "compile": "on" if compile_ else "off",
           "prologues": "on" if cfg.recompute_prologues else "off",
           "backend": backend, "step_s": t, "TFLOPs": flops / t / 1e12, "est_GiB": est.total / GIB}
    if peak:
        row["MFU"] = mfu(flops, t, peak)
    if cuda:
        row["peak_GiB"] = torch.cuda.max_memory_allocated() / GIB
        row["est_err"] = (est.total - torch.cuda.max_memory_allocated()) / torch.cuda.max_memory_allocated()
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return row


def _cp_worker(cfg, tokens, sample_tokens, precision, backend):
    """One rank of a cp_ulysses=world layout: activation bytes of one forward on this rank."""
    ctx = init_parallel(cfg.parallel)
    model = build_parallel_model(cfg, ctx)
    full, _ = make_pack(cfg.model, tokens, sample_tokens, "cpu")
    cp = ctx.dims.cp
    if cp > 1:
        local, meta = split_for_cp(full, cp, ctx.cp_rank, "contiguous")
        meta = meta.to(ctx.device)
    else:
        local, meta = full, VarlenLayout.build(full.seg, full.order, False)
    local = local.to(ctx.device)
    amp = torch.autocast(ctx.device.type, dtype=torch.bfloat16) if precision == "bf16" else torch.autocast(ctx.device.type, enabled=False)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with amp:
        fwd = lambda: video_forward(model, local, meta)  # noqa: E731
        saved, pred = saved_activation_bytes(fwd, exclude=list(model.parameters()))
    out = {"saved_bytes": saved, "local_tokens": int(local.seg.numel())}
    if cuda:
        out["peak_minus_base"] = torch.cuda.max_memory_allocated() - base
    ((pred.float() - local.tokens["target"]) ** 2).mean().backward()
    return out


def cp_memory(model_name, degrees, tokens, sample_tokens, precision, device, backend, prologues=(None,)):
    """Saved activation bytes per rank (max over ranks) vs the estimate, for each cp_ulysses
    degree and model.recompute_prologues setting in `prologues` (None: the config's)."""
    rows = []
    for k, pro in itertools.product(degrees, prologues):
        cfg = compose([f"model={model_name}", f"model.attn_backend={backend}", f"parallel.cp_ulysses={k}",
                       "parallel.dp_mode=none", f"parallel.device={device}", f"train.precision={precision}"]
                      + ([] if pro is None else [f"model.recompute_prologues={str(pro).lower()}"]))
        res = launch.launch_local(_cp_worker, (cfg, tokens, sample_tokens, precision, backend), k, cfg.launcher) if k > 1 \
            else {0: _cp_worker(cfg, tokens, sample_tokens, precision, backend)}
        shape = model_shape(cfg.model)
        est = estimate_memory(shape, RankSetup(micro_batch_tokens=tokens, checkpointing=False, cp_ulysses=k,
                                               precision=precision, backend=backend, dp_mode="none"))
        row = {"cp_ulysses": k, "prologues": "on" if cfg.model.recompute_prologues else "off",
               "tokens": tokens, "local_tokens": res[0]["local_tokens"],
               "saved_act_GiB": max(r["saved_bytes"] for r in res.values()) / GIB, "est_act_GiB": est.activations / GIB}
        if "peak_minus_base" in res[0]:
            row["cuda_fwd_peak_GiB"] = max(r["peak_minus_base"] for r in res.values()) / GIB
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dit_1b", help="a conf/model/*.yaml name")
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--sample-tokens", type=int, default=0, help="tokens per sample (default: one sample per pack)")
    ap.add_argument("--ac", default="off,on", help="activation checkpointing: comma list of none, selective, full (on = full, off = none)")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--backend", default="auto", help="comma list of kernels/attention backends")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6, help="steps per config; the first is warm-up")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="default 989 on CUDA (H100 bf16), none on CPU")
    ap.add_argument("--cp-memory", default="", help="e.g. 1,2,4,8: activation bytes per rank vs cp_ulysses")
    ap.add_argument("--prologues", default="", help="comma list of on/off: model.recompute_prologues settings "
                                                    "(default: the model config's)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    peak = a.peak_tflops or (989.0 if device.type == "cuda" else 0.0)
    cfg = model_cfg(a.model)
    tokens = [int(x) for x in a.tokens.split(",")]
    on = lambda s: [x == "on" for x in s.split(",")]  # noqa: E731
    prologues = on(a.prologues) if a.prologues else [None]
    if a.cp_memory:
        rows = cp_memory(a.model, [int(x) for x in a.cp_memory.split(",")], tokens[0], a.sample_tokens or tokens[0],
                         a.precision, a.device, a.backend if a.backend != "auto" else ("flash" if device.type == "cuda" else "sdpa"),
                         prologues)
        name = "cp_memory"
    else:
        rows = []
        policies = [ac_policy({"on": True, "off": False}.get(x, x)) for x in a.ac.split(",")]
        for T, ac, comp, backend, pro in itertools.product(tokens, policies, on(a.compile), a.backend.split(","), prologues):
            c = cfg if pro is None else replace(cfg, recompute_prologues=pro)
            rows.append(run_single(c, T, a.sample_tokens or T, ac, comp, backend, a.precision, device, a.steps, peak))
            print(format_table(rows[-1:]), flush=True)
        name = "mfu"
    shape = model_shape(cfg)
    print(f"model {a.model}: {shape.params / 1e6:.1f}M params ({shape.params_per_token / 1e6:.1f}M per-token matmul), "
          f"{a.precision}, device {a.device}{f', peak {peak:g} TFLOP/s' if peak else ''}")
    print(format_table(rows))
    p = write_json(a.out, name, {"args": vars(a), "rows": rows})
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
