"""One prepared check of dit_train on a GPU: correctness, MFU, speed against diffusers, planner
accuracy — in one process, within a time budget, writing one JSON (after every section, so a
run cut short keeps what it measured) and printing a table per section.

    python -m dit_train.tools.gpu_check --out DIR                     # on the GPU (~7 min, one H100/H200)
    python -m dit_train.tools.gpu_check --quick --device cpu --out D  # the CPU dry run (the suite runs it)
    python -m dit_train.tools.gpu_check --only mfu_compile,planner    # rerun some sections
    bash benchmarks/gpu/check.sh                                      # on a bare GPU machine (installs the carried wheels)

Sections, in order (each a function of dit_train/tools/gpu_check/{correctness,speed,planner_check}.py):
  env              device, torch/CUDA versions, memory
  matmul           bf16 n³ matrix product: the measured ceiling
  attention        every varlen backend present (sdpa, sdpa_dense, flex compiled; xformers, flash
                   where installed) vs an fp64 masked-softmax reference, uneven clips, forward and
                   backward, bidirectional and causal, fp32 and bf16
  ring_blocks      ring attention's per-sample block kernel with LSE (fused, flex, math) on a
                   zigzag split vs the fp64 dense reference: out, lse and gradients through both
  train_steps      two real trainer steps of the tiny DiT / Wan / LTX / HunyuanVideo presets on random
                   latents, bf16 vs fp32
  fsdp_world1      the trainer with FSDP2 over a process group of one (NCCL) vs the plain model
  compiled_blocks  train.compile's per-block torch.compile vs eager (outputs, gradients)
  mfu_eager        the ~1B DiT, bf16: 8k, 32k and 4 x 8k packed tokens, activation checkpointing
  vs_diffusers     Wan-1.3B shape: our packed step vs diffusers' WanTransformer3DModel (one
                   81 x 480 x 832 clip; mixed lengths padded and bucketed), tokens/s, peak memory
  planner          tools.plan's estimate vs the measured peak of a few real steps, 3 configurations
  mfu_compile      as mfu_eager with train.compile (compilation takes most of its time: last)
A failed bound is a row with pass=false, an exception a section with "error": neither stops the
rest. Exit code 0 when every section ran and every row passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dit_train.perf.bench import environment, format_table
from dit_train.tools.gpu_check import correctness, planner_check, speed

SECTIONS = ("env", "matmul", "attention", "ring_blocks", "train_steps", "fsdp_world1", "compiled_blocks", "mfu_eager", "vs_diffusers",
            "planner", "mfu_compile")


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the GPU sizes, or the CPU dry run's (same code, tiny shapes)."""

    attn_lens: tuple[int, ...]
    attn_heads: int
    attn_head_dim: int
    presets: tuple[str, ...]
    compile_check: bool
    matmul_n: int
    mfu_model: str
    mfu_eager: tuple[tuple[int, int, str, bool, str], ...]  # (tokens, tokens per sample, AC policy, compile, backend)
    mfu_compile: tuple[tuple[int, int, str, bool, str], ...]
    mfu_steps: int
    wan_model: str
    wan_overrides: tuple[str, ...]
    wan_workloads: dict[str, list[tuple[int, int, int]]]
    wan_reps: int
    planner_configs: tuple[tuple[tuple[str, ...], str], ...]
    planner_grids: tuple[tuple[int, int, int], ...]
    planner_steps: int


K = 1024
# Wan 2.1's 480p latents (VAE stride 4 x 8 x 8, patch 1 x 2 x 2): 17/33/49/81 frames at 480 x 832
WAN_480P = [(5, 60, 104), (9, 60, 104), (13, 60, 104), (21, 60, 104)]
GPU = Sizes(
    attn_lens=(517, 64, 1000, 3, 135), attn_heads=8, attn_head_dim=64,
    presets=("dit_tiny", "wan_tiny", "ltx_tiny", "hunyuan15_tiny"), compile_check=True, matmul_n=8192,
    mfu_model="dit_1b",
    mfu_eager=((8 * K, 8 * K, "none", False, "sdpa"), (32 * K, 32 * K, "none", False, "sdpa"),
               (32 * K, 8 * K, "none", False, "sdpa"), (32 * K, 8 * K, "none", False, "flex"),
               (32 * K, 32 * K, "full", False, "sdpa")),
    mfu_compile=((32 * K, 32 * K, "none", True, "sdpa"), (8 * K, 8 * K, "none", True, "sdpa"),
                 (32 * K, 8 * K, "none", True, "sdpa"), (32 * K, 32 * K, "selective", True, "sdpa"),
                 (32 * K, 32 * K, "full", True, "sdpa")),
    mfu_steps=5,
    wan_model="wan_1_3b", wan_overrides=(), wan_reps=2,
    wan_workloads={"one_clip_81x480x832": [WAN_480P[-1]], "mixed_17_33_49_81f": WAN_480P},
    planner_configs=((("model=dit_1b", "train.precision=bf16", "model.attn_backend=sdpa"), "none"),
                     (("model=dit_1b", "train.precision=bf16", "model.attn_backend=sdpa"), "full"),
                     (("model=wan_1_3b", "train.precision=bf16", "model.attn_backend=sdpa"), "full")),
    planner_grids=tuple((f, h // 2, w // 2) for f, h, w in WAN_480P), planner_steps=3,
)
CPU_QUICK = Sizes(
    attn_lens=(37, 5, 64), attn_heads=2, attn_head_dim=16, presets=("dit_tiny",), compile_check=False,
    matmul_n=256, mfu_model="dit_tiny", mfu_eager=((512, 256, "none", False, "sdpa"), (512, 512, "full", False, "sdpa")), mfu_compile=(),
    mfu_steps=2, wan_model="wan_tiny", wan_overrides=("model.in_channels=16", "model.patch_size=[1,2,2]"), wan_reps=1,
    wan_workloads={"one_clip": [(2, 4, 4)], "mixed": [(1, 4, 4), (2, 4, 8)]},
    planner_configs=((("model=dit_tiny",), "none"),), planner_grids=((2, 4, 4), (1, 3, 5)), planner_steps=2,
)


@dataclass
class Report:
    """The check's results, written to `path` after every section."""

    path: Path
    deadline: float
    data: dict[str, Any] = field(default_factory=dict)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        print(f"== {name} ({self.time_left():.0f} s left)", flush=True)
        try:
            result = fn()
            entry: dict[str, Any] = {"rows": result} if isinstance(result, list) else dict(result)
        except Exception as err:  # one section's failure is a finding, not the end of the check
            entry = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            print(entry["traceback"], flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        entry["seconds"] = time.monotonic() - t0
        self.data.setdefault("sections", {})[name] = entry
        self.write()
        rows = entry.get("rows")
        print(format_table(rows) if rows else json.dumps({k: v for k, v in entry.items() if k != "traceback"},
                                                         default=str), flush=True)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def failures(self) -> list[str]:
        out = []
        for name, entry in self.data.get("sections", {}).items():
            if "error" in entry:
                out.append(f"{name}: {entry['error']}")
            out += [f"{name}: {r}" for r in entry.get("rows", []) if isinstance(r, dict) and r.get("pass") is False]
        return out


def device_env(device: torch.device) -> dict[str, Any]:
    env = environment()
    env["device"] = str(device)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_mem_GiB=p.total_memory / 2 ** 30, sms=p.multi_processor_count,
                   cuda_runtime=torch.version.cuda, capability=f"{p.major}.{p.minor}")
    for mod in ("diffusers", "flash_attn", "xformers", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # not installed (or broken): recorded as absent
            env[mod] = None
    return env


def sections(device: torch.device, s: Sizes, report: Report) -> dict[str, Callable[[], Any]]:
    left = report.time_left
    capacity = torch.cuda.get_device_properties(device).total_memory / 2 ** 30 if device.type == "cuda" else 8.0
    return {
        "env": lambda: device_env(device),
        "matmul": lambda: speed.matmul_ceiling(device, s.matmul_n),
        "attention": lambda: correctness.attention(device, list(s.attn_lens), s.attn_heads, s.attn_head_dim),
        "ring_blocks": lambda: correctness.ring_blocks(device, list(s.attn_lens), s.attn_heads, s.attn_head_dim),
        "train_steps": lambda: correctness.train_steps(device, list(s.presets)),
        "fsdp_world1": lambda: correctness.fsdp_world1(device),
        "compiled_blocks": lambda: (correctness.compiled_blocks(device) if s.compile_check
                                    else {"skipped": "compile check off for this size set"}),
        "mfu_eager": lambda: speed.mfu_rows(device, s.mfu_model, list(s.mfu_eager), s.mfu_steps, left),
        "vs_diffusers": lambda: speed.vs_diffusers(device, s.wan_model, s.wan_workloads, s.wan_reps, left, s.wan_overrides),
        "planner": lambda: planner_check.planner_accuracy(device, [(list(o), ac) for o, ac in s.planner_configs],
                                                          list(s.planner_grids), s.planner_steps, left, capacity),
        "mfu_compile": lambda: speed.mfu_rows(device, s.mfu_model, list(s.mfu_compile), s.mfu_steps, left),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_train.tools.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_check", help="folder for gpu_check.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the CPU dry run)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="sections stop starting new work after this")
    ap.add_argument("--only", default="", help=f"comma list of sections (default all): {', '.join(SECTIONS)}")
    a = ap.parse_args(argv)
    unknown = set(filter(None, a.only.split(","))) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}: choose from {', '.join(SECTIONS)}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible; use --device cpu --quick for the dry run")
    sizes = CPU_QUICK if a.quick else GPU
    report = Report(Path(a.out) / "gpu_check.json", time.monotonic() + a.budget_s)
    report.data.update(command=" ".join(["python -m dit_train.tools.gpu_check", *(argv or [])]), quick=a.quick)
    todo = sections(device, sizes, report)
    names = [n for n in SECTIONS if not a.only or n in a.only.split(",") or n == "env"]
    for name in names:
        report.run(name, todo[name])
    failed = report.failures()
    print(f"wrote {report.path}; {len(names)} sections, {len(failed)} failures")
    for f in failed:
        print("FAILED " + f)
    return 1 if failed else 0
