"""Rank balance of the step plan: train.balance=tokens vs cost, modelled and measured.

    python -m dit_train.tools.bench_balance [--steps 20] [--measure-steps 4] [--out FILE] [--quick]
    python -m dit_train.tools.bench_balance --calibrate      # fit perf/cost.SPEEDS["cpu"] on this CPU

Modelled (the cost model of dit_train/perf/cost.py): for each length distribution and DP degree
(2, 8, 64; `--per-rank` samples a rank, grad_accum 1, train.micro_batch_tokens=0's budget: the
longest sample, at least 4096), the step plan of `--steps` steps under each balance; per step the
modelled max/mean rank time, then its mean over steps. `bound` is the best any placement can
do: max(heaviest sample, mean rank time) / mean. `speedup` is Σ max rank time of tokens / of
cost: the modelled step-time gain when every rank waits for the slowest at the gradient reduce
(DDP: plans made with StepCost.lockstep off); `speedup lockstep` the same for FSDP2, whose ranks
wait for each other at every layer of every micro-batch (Σ_k max_r of the ranks' k-th
micro-batches; plans made with it on). Both balances run the same number of micro-batches.

  wan_buckets   Wan 2.1 14B (`model=wan_14b`, CUDA speeds) on its buckets: 17/33/49/65/81 frames
                × 480p (480×832) / 720p (720×1280), uniform; tokens = ((F−1)/4+1)·(H/16)·(W/16)
                (VAE 4×8×8, patch 1×2×2): 7,800 … 75,600
  wan_mixed     the same with half the samples still images (one latent frame: 1,560 / 3,600)
  embedded      the tiny DiT (`model=dit_tiny`, CPU speeds) on the embedded clips (the default
                `data=synthetic_video`'s lengths, 96 … 320 tokens), drawn with replacement

Measured (`--measure-steps`, 0 = off): the real trainer at DP 2 (gloo, one thread per rank) on
in-memory mixed clips (a third images, the rest 2–32-frame clips, of 32² or 48² pixels: 64 …
4,608 tokens; a tiny DiT, dim 64, depth 2), with parallel.dp_mode ddp and fsdp2
(`--measure-modes`), tokens and cost runs interleaved step by step in one launch. Each rank's
compute is its main thread's CPU time (torch runs CPU kernels there; gloo's waits do not spin),
which the other jobs of a shared machine disturb far less than wall time (printed too). The
step time dedicated cores would give: under DDP the slowest rank's total; under FSDP2
(lockstep) Σ_k of the slowest rank's k-th micro-batch, plus the slowest rank's rest of the step.

--calibrate: fits perf/cost.DeviceSpeed (per micro-batch, per sample, linear and attention
FLOP/s) to measured CPU times of one forward + backward of that tiny DiT on packs of 1–16
samples of 64–2,048 tokens (non-negative least squares on relative errors), and prints each
pack's measured, fitted and currently-modelled milliseconds.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.data_pipelines.packing import StepCost, lockstep_time, plan_step, rank_times
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.engine.build import build_run
from dit_train.engine.layout_equivalence import apply_layout
from dit_train.kernels import VarlenLayout
from dit_train.models import build_model
from dit_train.models.init import init_weights
from dit_train.parallel.mesh import init_parallel
from dit_train.perf.bench import format_table, write_json
from dit_train.perf.cost import SPEEDS, DeviceSpeed, run_cost, step_cost
from dit_train.perf.flops import attention_flops, train_flops
from dit_train.perf.memory import model_shape
from dit_train.tasks import auto_micro_batch_tokens, build_task
from dit_train.tasks.video import VideoTask

WAN_FRAMES = (17, 33, 49, 65, 81)
WAN_SIZES = ((480, 832), (720, 1280))
# the measured run's model and clips: small enough for 2 busy cores, attention-heavy like video
TINY = ["model.dim=64", "model.depth=2", "model.heads=4", "model.patch_size=[1,4,4]", "model.text_dim=0",
        "model.init=normal", "optim=sgd", "train.progress=false", "train.sample_every=0", "train.ema_decay=0",
        "train.save_weights=false"]
CLIP_SIZES = (32, 48)  # square clips; 64 / 144 tokens a frame at 4x4 patches
CLIP_FRAMES = (1, 1, 2, 8, 16, 32)  # 1 = an image: a third of the samples
CALIBRATION_PACKS = ([2048], [1024], [512], [256] * 4, [64] * 16, [144] * 8, [1024, 64, 64, 64, 64],
                     [512, 512], [1152, 576, 144], [256] * 8)


def wan_tokens(frames: int, height: int, width: int) -> int:
    """Tokens of a clip for Wan 2.1: VAE 4× in time (plus the first frame), 8× in space, patch 1×2×2."""
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


def wan_lengths(n: int, images: float, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        h, w = WAN_SIZES[rng.integers(len(WAN_SIZES))]
        out.append(wan_tokens(1 if rng.random() < images else int(rng.choice(WAN_FRAMES)), h, w))
    return out


def embedded_lengths(n: int, clips: int = 48, cache_dir: str = "", seed: int = 0) -> list[int]:
    """The default embedded set's lengths (its first `clips` clips, written under `cache_dir`
    if not there yet; "" = data.cache_dir), drawn with replacement."""
    cfg = compose([f"data.num_clips={clips}", *([f"data.cache_dir={cache_dir}"] if cache_dir else [])])
    prepare_data(cfg.data, cfg.model)
    base = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, 0).lengths()
    return [int(x) for x in np.random.default_rng(seed).choice(base, size=n)]


def distributions(n: int, clips: int = 48, cache_dir: str = "") -> dict[str, tuple[list[int], StepCost]]:
    wan = step_cost(model_shape(compose(["model=wan_14b"]).model), SPEEDS["cuda"])
    tiny = step_cost(model_shape(compose([]).model), SPEEDS["cpu"])
    return {"wan_buckets": (wan_lengths(n, 0.0), wan), "wan_mixed": (wan_lengths(n, 0.5), wan),
            "embedded": (embedded_lengths(n, clips, cache_dir), tiny)}


def modelled(lengths: list[int], cost: StepCost, dp: int, per_rank: int, steps: int) -> dict[str, float]:
    """Mean over steps of modelled max/mean rank time per balance (ranks meeting at the reduce),
    the bound, and the step-time gains of cost over tokens without and with lockstep."""
    d = dict(enumerate(lengths))
    budget = auto_micro_batch_tokens(lengths)
    ratio: dict[str, list[float]] = {"tokens": [], "cost": []}
    total = {("tokens", False): 0.0, ("cost", False): 0.0, ("tokens", True): 0.0, ("cost", True): 0.0}
    bound, micro = [], 0
    for s in range(steps):
        for lock in (False, True):
            c = replace(cost, lockstep=lock)
            for name in ratio:
                plan = plan_step(s, d, dp * per_rank, dp, 1, budget, 0, cost=c if name == "cost" else None)
                t = rank_times(plan.micro_batches, d, c)
                total[name, lock] += lockstep_time(plan.micro_batches, d, c) if lock else max(t)
                if not lock:
                    ratio[name].append(max(t) / statistics.fmean(t))
                if not lock and name == "tokens":  # both balances run this many micro-batches
                    micro += plan.num_micro
                    mean = statistics.fmean(t)  # the same for any placement of the step's samples
                    bound.append(max(mean, max(cost.micro([d[i]]) for i in plan.sample_ids)) / mean)
    return {"tokens max/mean": statistics.fmean(ratio["tokens"]), "cost max/mean": statistics.fmean(ratio["cost"]),
            "bound": statistics.fmean(bound), "speedup": total["tokens", False] / total["cost", False],
            "speedup lockstep": total["tokens", True] / total["cost", True], "micro/rank": micro / steps}


# --------------------------------------------------------------------------- measured


class MixedClips:
    """In-memory clips of the measured run: random pixels in [-1, 1], sizes drawn once (no
    decoding, so a step's time is the model's)."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.shapes = [(int(rng.choice(CLIP_FRAMES)), int(rng.choice(CLIP_SIZES))) for _ in range(n)]
        self.patch = (1, 4, 4)
        self._cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.shapes)

    def lengths(self) -> list[int]:
        return [f * (s // 4) ** 2 for f, s in self.shapes]

    def __getitem__(self, i: int) -> SimpleNamespace:
        if i not in self._cache:
            f, s = self.shapes[i]
            self._cache[i] = torch.rand(3, f, s, s, generator=torch.Generator().manual_seed(i)) * 2 - 1
        return SimpleNamespace(pixels=self._cache[i], caption="")


def measure_worker(cfgs: dict, clips: int, steps: int) -> dict:
    """On each rank: {(mode, balance): [(thread CPU s, wall s, [thread CPU s of each micro-batch])
    per step]} for steps 1..steps (step 0 warms up), all runs interleaved step by step, their
    order alternating. A micro-batch's time runs from its forward to the next one's (its
    backward included); the rest of the step (data, the metadata sync, the optimizer) is the
    step's time less theirs."""
    meshes: dict[str, object] = {}
    runs = {}
    for key, cfg in cfgs.items():
        ctx = meshes[repr(cfg.parallel)] = meshes.get(repr(cfg.parallel)) or init_parallel(cfg.parallel)
        task = VideoTask(MixedClips(clips), cfg.model, cfg.loss, cfg.train.seed)
        runs[key] = build_run(cfg, ctx, task=task)
    marks: list[float] = []
    for run in runs.values():
        forward = run.trainer.per_token_loss

        def timed(*args, _forward=forward, **kwargs):
            marks.append(time.thread_time())
            return _forward(*args, **kwargs)

        run.trainer.per_token_loss = timed
    out: dict = {key: [] for key in cfgs}
    for s in range(steps + 1):
        for key in (list(cfgs) if s % 2 == 0 else list(reversed(cfgs))):
            marks.clear()
            c0, w0 = time.thread_time(), time.perf_counter()
            runs[key].trainer.step(s)
            c1, w1 = time.thread_time(), time.perf_counter()
            if s:  # the last micro-batch ends where its backward does: before clip and optimizer, here at step end
                out[key].append((c1 - c0, w1 - w0, [b - a for a, b in zip(marks, [*marks[1:], c1])]))
    return out


def measured(clips: int, global_batch: int, steps: int, modes: list[str]) -> list[dict]:
    """Rows per (dp_mode, balance): measured and modelled step times at DP 2 (see the module
    docstring). ddp: a step takes its slowest rank's total; fsdp2: Σ_k of the slowest rank's
    k-th micro-batch plus the slowest rest (lockstep)."""
    cfgs = {}
    for mode in modes:
        base = compose([*TINY, "parallel.dp_shard=2", f"parallel.dp_mode={mode}", f"train.global_batch={global_batch}",
                        f"train.steps={steps + 1}"])
        for name in ("tokens", "cost"):
            cfgs[mode, name] = apply_layout(base, {"balance": name})
    per_rank = launch.launch_local(measure_worker, (cfgs, clips, steps), 2, base.launcher)
    lengths = dict(enumerate(MixedClips(clips).lengths()))
    budget = auto_micro_batch_tokens(list(lengths.values()))
    rows = []
    for (mode, name), cfg in cfgs.items():
        cost = run_cost(model_shape(cfg.model), cfg.model, cfg.parallel, "cpu")  # what the trainer planned with
        got = [[per_rank[r][mode, name][k] for r in sorted(per_rank)] for k in range(steps)]  # [step][rank]
        if cost.lockstep:
            step_cpu = [sum(map(max, zip(*(m for _, _, m in ranks)))) + max(t - sum(m) for t, _, m in ranks)
                        for ranks in got]
        else:
            step_cpu = [max(t for t, _, _ in ranks) for ranks in got]
        plans = [plan_step(s, lengths, global_batch, 2, 1, budget, 0, cost=cost if name == "cost" else None)
                 for s in range(1, steps + 1)]
        model_t = [rank_times(p.micro_batches, lengths, cost) for p in plans]
        model_step = [lockstep_time(p.micro_batches, lengths, cost) if cost.lockstep else max(t)
                      for p, t in zip(plans, model_t)]
        rows.append({"dp_mode": mode, "balance": name, "step CPU s": statistics.fmean(step_cpu),
                     "measured max/mean": statistics.fmean(max(t for t, _, _ in ranks) / statistics.fmean(
                         t for t, _, _ in ranks) for ranks in got),
                     "modelled max/mean": statistics.fmean(max(t) / statistics.fmean(t) for t in model_t),
                     "modelled step s": statistics.fmean(model_step),
                     "wall s (median)": statistics.median(ranks[0][1] for ranks in got)})
        if name == "cost":
            tok = rows[-2]
            rows[-1]["measured speedup"] = tok["step CPU s"] / rows[-1]["step CPU s"]
            rows[-1]["modelled speedup"] = tok["modelled step s"] / rows[-1]["modelled step s"]
    return rows


# --------------------------------------------------------------------------- calibration


def pack_seconds(model, task: VideoTask, dataset: "SizedClips", sizes: list[int], reps: int) -> float:
    """Median CPU seconds of one forward + backward of a pack of samples of `sizes` tokens."""
    ids = dataset.add(sizes)
    batch = task.build(ids, 0)
    attn = VarlenLayout.build(batch.seg, batch.order, False)
    times = []
    for _ in range(reps + 1):
        t0 = time.process_time()
        task.per_token_loss(model, batch, attn).sum().backward()
        times.append(time.process_time() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


class SizedClips(MixedClips):
    """Clips of given token counts: frames of 144 tokens (48² pixels at 4×4 patches) or of 64 (32²)."""

    def __init__(self):
        super().__init__(0)

    def add(self, sizes: list[int]) -> list[int]:
        start = len(self.shapes)
        self.shapes += [(n // 144, 48) if n % 144 == 0 else (n // 64, 32) for n in sizes]
        return list(range(start, len(self.shapes)))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a·x − b| with x ≥ 0, by trying every set of free variables (a handful of them)."""
    best, best_x = np.inf, np.zeros(a.shape[1])
    for k in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), k):
            x_free, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
            if (x_free < 0).any():
                continue
            x = np.zeros(a.shape[1])
            x[list(free)] = x_free
            r = float(np.linalg.norm(a @ x - b))
            if r < best:
                best, best_x = r, x
    return best_x


def calibrate(reps: int) -> tuple[list[dict], DeviceSpeed]:
    torch.set_num_threads(1)
    cfg = compose(TINY)
    model = build_model(cfg.model, "sdpa")
    init_weights(model, 0, "normal")
    shape = model_shape(cfg.model)
    clips = SizedClips()
    task = VideoTask(clips, cfg.model, cfg.loss, 0)
    packs = list(CALIBRATION_PACKS)
    secs = [pack_seconds(model, task, clips, p, reps) for p in packs]
    feats = np.array([[1.0, len(p), train_flops(shape, p) - attention_flops(shape, p), attention_flops(shape, p)]
                      for p in packs])
    y = np.array(secs)
    x = nnls(feats / y[:, None], np.ones_like(y))  # relative errors: short packs count as much as long
    fit = DeviceSpeed(linear_flops=1 / x[2] if x[2] else float("inf"), attention_flops=1 / x[3] if x[3] else float("inf"),
                      sample_s=float(x[1]), micro_s=float(x[0]))
    now, new = step_cost(shape, SPEEDS["cpu"]), step_cost(shape, fit)
    rows = [{"pack": f"{len(p)}×{p[0]}" if len(set(p)) == 1 else "+".join(map(str, p)), "measured ms": 1e3 * s,
             "fit ms": 1e3 * new.micro(p), "fit err": new.micro(p) / s - 1,
             "SPEEDS ms": 1e3 * now.micro(p), "SPEEDS err": now.micro(p) / s - 1} for p, s in zip(packs, secs)]
    return rows, fit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="modelled steps per distribution and DP degree")
    ap.add_argument("--per-rank", type=int, default=4, help="samples per DP rank in the modelled plans")
    ap.add_argument("--dp", default="2,8,64")
    ap.add_argument("--measure-steps", type=int, default=6, help="measured steps per balance at DP 2 (0 = off)")
    ap.add_argument("--measure-modes", default="ddp,fsdp2", help="parallel.dp_mode of the measured runs")
    ap.add_argument("--clips", type=int, default=256, help="in-memory clips of the measured run")
    ap.add_argument("--measure-batch", type=int, default=16, help="global batch of the measured run")
    ap.add_argument("--calibrate", action="store_true", help="fit the CPU speeds instead (see above)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per calibration pack")
    ap.add_argument("--cache-dir", default="", help="where the embedded clips are written (default data.cache_dir)")
    ap.add_argument("--quick", action="store_true", help="few steps and samples (a smoke test)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.calibrate:
        rows, fit = calibrate(1 if a.quick else a.reps)
        print(format_table(rows))
        print(f"fitted: {fit}")
        p = write_json(a.out, "balance_calibration", {"args": vars(a), "rows": rows, "fit": vars(fit)})
        print(f"wrote {p}")
        return 0
    if a.quick:
        a.steps, a.dp, a.measure_steps, a.clips, a.measure_batch = 2, "2,8", min(a.measure_steps, 1), 32, 8
        a.measure_modes = "ddp"
    dps = [int(x) for x in a.dp.split(",")]
    rows = []
    dists = distributions(max(dps) * a.per_rank * a.steps, 16 if a.quick else 48, a.cache_dir)
    for name, (lengths, cost) in dists.items():
        for dp in dps:
            rows.append({"distribution": name, "dp": dp, **modelled(lengths, cost, dp, a.per_rank, a.steps)})
    print(format_table(rows))
    meas = measured(a.clips, a.measure_batch, a.measure_steps, a.measure_modes.split(",")) if a.measure_steps else []
    if meas:
        print(format_table(meas))
    p = write_json(a.out, "balance", {"args": vars(a), "modelled": rows, "measured": meas})
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
