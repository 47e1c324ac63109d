"""Speed on the device: the bf16 matmul ceiling, MFU of the ~1B DiT, and our packed Wan against
diffusers' own WanTransformer3DModel on the same clips.

Model FLOPs (dit_train/perf/flops.py, counted as NeMo DFM counts model TFLOP/s: 6·N·ΣT_b for the
matmuls plus 12·d·depth·ΣT_b² for attention, recomputation not counted), over the median step
time after a warm-up step (torch.cuda.synchronize around each step).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import torch

from dit_train.compose import compose
from dit_train.kernels import VarlenLayout, resolve_backend
from dit_train.models import build_model, model_spec
from dit_train.parallel.checkpointing import apply_activation_checkpointing
from dit_train.perf.memory import GIB
from dit_train.tools import bench_mfu, bench_wan

# dense bf16 peak of the Hopper parts (the figure MFU is quoted against); H200 has H100's chip
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def nominal_peak(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 989.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of `reps` calls of fn after `warmup` calls, each synchronised."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def matmul_ceiling(device: torch.device, n: int) -> list[dict[str, Any]]:
    """bf16 n×n×n matrix product on random data: the measured ceiling MFU is read against."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    t = statistics.median(timed(lambda: a @ b, device, reps=10, warmup=3))
    return [{"n": n, "ms": t * 1e3, "TFLOPs": 2 * n ** 3 / t / 1e12}]


def mfu_rows(device: torch.device, model: str, configs: list[tuple[int, int, str, bool, str]], steps: int,
             time_left: Callable[[], float], precision: str = "bf16") -> list[dict[str, Any]]:
    """One row per (tokens, tokens per sample, activation checkpointing, compile, attention backend), through
    tools.bench_mfu's single-device step (model built and drawn on the device, AdamW, autocast);
    configs that would start with under a minute left are listed as skipped."""
    if not configs:  # the CPU dry run's mfu_compile: no row, and no config to compose (a Hydra compose)
        return []
    cfg = bench_mfu.model_cfg(model)
    peak = nominal_peak(device)
    rows = []
    for tokens, sample_tokens, ac, compiled, backend in configs:
        if time_left() < 60:
            rows.append({"tokens": tokens, "samples": tokens // sample_tokens, "ac": ac, "compile": "on" if compiled else "off",
                         "backend": backend, "skipped": "time budget"})
            continue
        rows.append(guarded(lambda: bench_mfu.run_single(cfg, tokens, sample_tokens, ac, compiled, backend, precision,
                                                         device, steps, peak),
                            {"tokens": tokens, "samples": tokens // sample_tokens, "ac": ac, "backend": backend,
                             "compile": "on" if compiled else "off"}, device))
    return rows


def guarded(fn: Callable[[], dict[str, Any]], label: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """fn()'s row, or `label` with the error (out of memory, a kernel that will not build): one
    configuration's failure is a row of the table, the next configuration still runs."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported in the row
        row = {**label, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    gc.collect()  # the failed step's frames held its model and activations
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------- against diffusers


def _wan_pair(cfg, device: torch.device):
    """Our packed Wan and diffusers' WanTransformer3DModel holding the same weights, on `device`."""
    with torch.device(device):
        ours = build_model(cfg, resolve_backend("sdpa", device))
        for p in ours.parameters():  # a speed benchmark: values need only be finite, drawn where they live
            torch.nn.init.normal_(p, std=0.02)
        theirs = model_spec(cfg).to_diffusers(ours.state_dict(), cfg)
    return ours, theirs


def _to(args: tuple, device: torch.device) -> tuple:
    out = []
    for a in args:
        if isinstance(a, VarlenLayout):
            a = VarlenLayout.build(a.seg.to(device), a.pos.to(device), a.causal)
        elif isinstance(a, torch.Tensor):
            a = a.to(device)
        out.append(a)
    return tuple(out)


def vs_diffusers(device: torch.device, model: str, workloads: dict[str, list[tuple[int, int, int]]], reps: int,
                 time_left: Callable[[], float], overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Tokens/s and peak memory of a training step (forward + backward, bf16 autocast, full
    activation checkpointing on both sides: a 32k-token clip of a 1.3B model does not fit without)
    of our packed Wan against diffusers' on the same latent clips. diffusers takes no
    self-attention mask, so mixed lengths run either zero-padded to the largest clip in one batch
    (`padded`) or one batch per shape (`bucketed`); ours packs every clip into one sequence."""
    cfg = compose([f"model={model}", *overrides]).model
    ours, theirs = _wan_pair(cfg, device)
    apply_activation_checkpointing(model_spec(cfg).blocks(ours), "full")
    theirs.enable_gradient_checkpointing()
    text_dim = cfg.text_dim
    rows = []
    for name, shapes in workloads.items():
        if time_left() < 45:
            rows.append({"workload": name, "skipped": "time budget"})
            continue
        rows.append(guarded(lambda: _workload_row(name, shapes, ours, theirs, text_dim, reps, device),
                            {"workload": name}, device))
    params = sum(p.numel() for p in ours.parameters())
    del ours, theirs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"model": model, "params": params, "ac": "full (both)", "precision": "bf16 autocast", "rows": rows}


def _workload_row(name: str, shapes: list[tuple[int, int, int]], ours, theirs, text_dim: int, reps: int,
                  device: torch.device) -> dict[str, Any]:
    """Tokens/s and peak memory of ours (one pack) and diffusers' (bucketed; padded when the
    shapes differ) on `shapes`."""
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    o_args, o_tgt = bench_wan.ours_inputs(shapes, text_dim)
    o_args, o_tgt = _to(o_args, device), o_tgt.to(device)
    bucketed = [_to(b, device) for b in bench_wan.wan_inputs(shapes, text_dim)]

    def run_ours():
        ours.zero_grad(set_to_none=True)
        with amp:
            out = ours(*o_args)
        ((out.float() - o_tgt) ** 2).mean().backward()

    def run_batches(batches):
        def run():
            theirs.zero_grad(set_to_none=True)
            for x, t, txt, tgt in batches:
                with amp:
                    out = theirs(x, t, txt, return_dict=False)[0]
                ((out.float() - tgt) ** 2).mean().backward()
        return run

    fns = {"ours": run_ours, "diffusers_bucketed": run_batches(bucketed)}
    if len(set(shapes)) > 1:
        fns["diffusers_padded"] = run_batches([_to(bench_wan.wan_padded_input(shapes, text_dim), device)])
    n = bench_wan.tokens(shapes)
    row: dict[str, Any] = {"workload": name, "clips": len(shapes), "tokens": n}
    for key, fn in fns.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = statistics.median(timed(fn, device, reps=reps))
        row[f"{key}_tok_s"] = n / t
        if device.type == "cuda":
            row[f"{key}_peak_GiB"] = torch.cuda.max_memory_allocated(device) / GIB
    for key in fns:
        if key != "ours":
            row[f"speedup_vs_{key.removeprefix('diffusers_')}"] = row["ours_tok_s"] / row[f"{key}_tok_s"]
    return row
