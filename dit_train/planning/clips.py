""""How many frames fit": the planner asked about one clip size instead of a workload.

A clip of `frames x height x width` pixels is `clip_tokens` tokens for a video model (the VAE's
compression, then the model's patch). For each memory option (activation checkpointing policy x
activation offload x FSDP2 parameter offload) `clip_options` finds the best layout of `world`
ranks (CP degrees, sharding, micro-batch = the clip) that trains such a clip within the GPU's
memory, and the longest clip of that height and width that still fits with some layout.
Memory model: dit_train/perf/memory.py (per-rank, one micro-batch of one clip).
CLI: `python -m dit_train.tools.plan ... --frames 81 --height 480 --width 832`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dit_train.config import Config
from dit_train.perf.memory import GIB, ModelShape
from dit_train.planning.planner import Candidate, Workload, plan

# (AC policy, activation offload, parameter offload), cheapest first
OPTIONS: list[tuple[str, bool, bool]] = [(ac, act, cpu) for ac in ("none", "selective", "full")
                                         for act, cpu in ((False, False), (True, False), (False, True), (True, True))]
WAN_VAE_STRIDE = (4, 8, 8)  # Wan-VAE: 4x in time (plus the first frame), 8x in height and width


def latent_grid(frames: int, height: int, width: int, vae_stride: tuple[int, int, int] = WAN_VAE_STRIDE
                ) -> tuple[int, int, int]:
    """Latent (frames, height, width) of a pixel clip: (F - 1) // t + 1 frames (causal VAE)."""
    t, s_h, s_w = vae_stride
    return (frames - 1) // t + 1, height // s_h, width // s_w


def clip_tokens(model_cfg: Any, frames: int, height: int, width: int,
                vae_stride: tuple[int, int, int] = WAN_VAE_STRIDE) -> int:
    """Tokens of one clip for a video model (its patch_size over the latent grid)."""
    grid = latent_grid(frames, height, width, vae_stride)
    p = list(model_cfg.patch_size)
    n = 1
    for g, q in zip(grid, p):
        n *= g // q
    return n


@dataclass
class OptionResult:
    option: tuple[str, bool, bool]
    best: Candidate | None  # best layout at the asked size (fits, or the closest miss)
    longest_frames: int  # longest clip (pixel frames) that fits with some layout; 0 = none
    longest: Candidate | None

    @property
    def name(self) -> str:
        ac, act, cpu = self.option
        return "+".join([f"ac={ac}"] + ["act_offload"] * act + ["cpu_offload"] * cpu)

    def row(self, frames: int) -> dict[str, Any]:
        b, lg = self.best, self.longest
        r = {"option": self.name, f"fits_{frames}f": "yes" if b is not None and b.fits else "no"}
        if b is not None:
            L = b.layout
            r.update(layout=f"shard{L.dp_shard}·rep{L.dp_replicate}·uly{L.cp_ulysses}·ring{L.cp_ring}",
                     **prologue_column("prologues", L), GiB=round(b.memory.total / GIB, 1), host_GiB=round(b.memory.host / GIB, 1))
        r["longest_frames"] = self.longest_frames
        if lg is not None:
            L = lg.layout
            r["longest_layout"] = f"uly{L.cp_ulysses}·ring{L.cp_ring}·shard{L.dp_shard}"
            r["longest_tokens"] = L.micro_batch_tokens
            r.update(prologue_column("longest_prologues", L))
        return r

    def to_json(self) -> dict[str, Any]:
        return {"option": self.name, "best": self.best.to_json() if self.best else None,
                "longest_frames": self.longest_frames, "longest": self.longest.to_json() if self.longest else None}


def prologue_column(name: str, layout) -> dict[str, str]:
    """{name: on|off} where the layout sets model.recompute_prologues; nothing for a model
    without prologues (Wan), so its table keeps its columns."""
    if layout.recompute_prologues is None:
        return {}
    return {name: "on" if layout.recompute_prologues else "off"}


def best_for_tokens(cfg: Config, world: int, capacity: float, tokens: int, option: tuple[str, bool, bool], *,
                    shape: ModelShape, reserve_bytes: float, backend: str, host_capacity: float,
                    prologue_options: tuple[bool, ...] = ()) -> Candidate | None:
    """The best layout of `world` ranks for one clip of `tokens` tokens under `option` and any
    of `prologue_options` (model.recompute_prologues; empty: the config's): fitting (device and
    host memory) first, else the closest miss; None if no layout is valid."""
    ac, act, cpu = option
    work = Workload(global_batch=world, max_sample_tokens=tokens, mean_sample_tokens=tokens)
    cands, _ = plan(cfg, world, capacity, work, reserve_bytes=reserve_bytes, backend=backend, ac_options=(ac,),
                    offload_options=((act, cpu),), max_micro_tokens=tokens, shape=shape,
                    prologue_options=prologue_options)
    if not cands:
        return None
    ok = [c for c in cands if c.fits and c.memory.host <= host_capacity]
    return ok[0] if ok else min(cands, key=lambda c: c.memory.total)


def longest_fitting(fits: Callable[[int], Candidate | None], limit: int) -> tuple[int, Candidate | None]:
    """Largest k in [1, limit] with fits(k) (monotone: larger k never fits once k fails)."""
    lo, best = 0, None
    hi = 1
    while hi <= limit:
        c = fits(hi)
        if c is None:
            break
        lo, best, hi = hi, c, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = fits(mid)
        if c is None:
            hi = mid
        else:
            lo, best = mid, c
    return lo, best


def clip_options(cfg: Config, world: int, capacity: float, frames: int, height: int, width: int, *,
                 shape: ModelShape, reserve_bytes: float = 0.0, backend: str = "flash",
                 host_capacity: float = float("inf"), vae_stride: tuple[int, int, int] = WAN_VAE_STRIDE,
                 max_frames: int = 4001, options: list[tuple[str, bool, bool]] | None = None,
                 prologue_options: tuple[bool, ...] = ()) -> list[OptionResult]:
    """For each memory option: the best layout for the asked clip and the longest clip (pixel
    frames 1 + t·k, k latent-frame steps) of the same height and width that fits; each layout
    with one of `prologue_options` (model.recompute_prologues; empty: the config's)."""
    t = vae_stride[0]
    out = []
    for option in options or OPTIONS:
        def at(n_frames: int, option=option) -> Candidate | None:
            tokens = clip_tokens(cfg.model, n_frames, height, width, vae_stride)
            if tokens < 1:
                return None
            return best_for_tokens(cfg, world, capacity, tokens, option, shape=shape, reserve_bytes=reserve_bytes,
                                   backend=backend, host_capacity=host_capacity, prologue_options=prologue_options)

        def fits(k: int) -> Candidate | None:
            c = at(1 + t * (k - 1))
            return c if c is not None and c.fits and c.memory.host <= host_capacity else None

        k, longest = longest_fitting(fits, (max_frames - 1) // t + 1)
        out.append(OptionResult(option, at(frames), 1 + t * (k - 1) if k else 0, longest))
    return out
