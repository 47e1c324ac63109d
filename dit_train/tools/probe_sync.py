"""Where a two-stream run's chain from picture to click breaks: linear probes on its hidden states.

    python -m dit_train.tools.probe_sync outputs/v2a --clips 600            # its sound at t = 1
    python -m dit_train.tools.probe_sync outputs/v2a --clips 600 --t 0.5

The embedded world's sound clicks where the shape touches a wall (docs/audio-video.md). A run
that makes the click from the picture must (1) carry the bounce in the given video's hidden
states and (2) move it into the audio token of the bounce's frame. Each clip with sound of the
run's training set (ids 0, 1, ... until --clips of them) is given its clean video, as
`cond.given_stream=video` trains it, and its sound's tokens noised at --t (1: pure noise, where
sampling starts); a forward hook keeps each block's output. Per block, two ridge probes fitted on
the even clips and scored on the odd ones (AUC: 0.5 is chance, 1 perfect):

- video: "a bounce in this temporal patch", from the mean, max and min of the patch's video tokens
  (the bounces seen in the clip's own pixels, as the sound metric finds them);
- audio: "this token holds a click", from each audio token (the one where a bounce frame's click
  starts).

A few hundred clips are needed: with ~100 the video probe (3 x model.dim features) reads near
chance whatever the run. One process, no collective; the run's EMA weights when it has them.

The same forward also gives the sound's x̂0, teacher-forced: its **click gain** (the projection
of x̂0 − m on x0 − m at the click tokens, m the clip's median audio token, which holds the tone
and no click: 1 = the click, 0 = none) and its mean squared error at the click tokens and at the
others. Run at several --t, it shows the noise level above which the click stops coming from the
noisy sound itself and must come from the video (docs/audio-video.md).

And per **place in the temporal patch** (an audio token's index there: 8 places for 500-sample
tokens and 2-frame patches at 8 fps), x̂0's projection on the mean click (over every click token
of the probed clips, relative to its clip's median token), at click tokens and at the others. The
world's clicks start at a frame's first token only, so a run that knows where its tokens sit puts
more there than elsewhere; one that reads the bounce, more at the click tokens of that place than
at the others of it.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np
import torch

from dit_train.batch import video_forward
from dit_train.config.choices import GivenStream
from dit_train.data_pipelines.shapes_sound_metric import bounce_frames
from dit_train.data_pipelines.synthetic_video import CLICK_OFFSET
from dit_train.generate import load_run
from dit_train.kernels import VarlenLayout
from dit_train.tasks import build_task

PACK = 8  # clips per forward


def click_gain(x0: torch.Tensor, x0_hat: torch.Tensor, clicks: torch.Tensor) -> tuple[list, list, list, list]:
    """One clip's audio tokens x0, x0_hat [n, width] and clicks [n] bool (its click tokens) ->
    per click token <x̂0 − m, x0 − m> and |x0 − m|² (m: the clip's median token, the tone without a
    click), and the squared errors at the click tokens and at the others. The gain is the sum of
    the first over the sum of the second (a click token whose click is cut off at the clip's end
    has |x0 − m| ≈ 0 and would blow up a per-token ratio)."""
    m = x0.median(0).values
    err = ((x0_hat - x0) ** 2).mean(1)
    d = x0[clicks] - m
    return ((x0_hat[clicks] - m) * d).sum(1).tolist(), (d * d).sum(1).tolist(), err[clicks].tolist(), err[~clicks].tolist()


def place_gains(along: torch.Tensor, places: torch.Tensor, clicks: torch.Tensor) -> list[tuple]:
    """Per place in the temporal patch: (place, mean of `along` over its click tokens, their count,
    the mean over its other tokens, their count); along, places [n] (int64), clicks [n] bool over
    every probed audio token. A mean over no token is nan."""
    rows = []
    for p in range(int(places.max()) + 1 if places.numel() else 0):
        at = places == p
        hit, miss = along[at & clicks], along[at & ~clicks]
        mean = lambda v: float(v.mean()) if v.numel() else float("nan")  # noqa: E731
        rows.append((p, mean(hit), hit.numel(), mean(miss), miss.numel()))
    return rows


def _features(task, model, items: dict, t: float, gen: torch.Generator) -> tuple[dict, dict]:
    """Hidden states of one pack's clips (items: {sample id: its dataset item}, read once by the
    caller): per block, video rows [patches, 3·dim] and audio rows [tokens, dim], with their
    labels and clip ids; the sound's click gains and errors (click_gain) under "gain"; each audio
    token's x̂0 − m and place in its temporal patch, each click token's x0 − m (m: its clip's
    median token) under "dev", "place", "click_dev"."""
    b = task.build(list(items), 0)
    audio = b.stream == 1
    width = model.audio_dim
    x = b.tokens["x"].clone()
    t0 = b.samples["t"][b.seg.clamp(min=0)]
    x0 = x - t0[:, None] * b.tokens["target"]  # x_t − t·(ε − x0): the audio tokens' clean values
    x[audio, :width] = (1 - t) * x0[audio, :width] + t * torch.randn(x0[audio, :width].shape, generator=gen)
    kept: dict[int, torch.Tensor] = {}
    hooks = [blk.register_forward_hook(lambda m, i, o, k=k: kept.__setitem__(k, o.detach()))
             for k, blk in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            out = video_forward(model, b, VarlenLayout.build(b.seg, b.mask_order, b.causal), x=x,
                                t=torch.full_like(b.samples["t"], t))[:, :width].float()
    finally:
        for h in hooks:
            h.remove()
    pt = task.patch[0]
    video = {"X": {k: [] for k in kept}, "y": [], "clip": []}
    sound = {"X": {k: [] for k in kept}, "y": [], "clip": [], "gain": ([], [], [], []), "dev": [], "place": [],
             "click_dev": []}
    # the model's x̂0 of the sound (model.prediction: x0 outputs it, velocity v gives x_t − t·v)
    x0_hat = out if task.inputs.prediction == "x0" else x[:, :width] - t * out
    for c, sid in enumerate(b.sample_ids.tolist()):
        item = items[sid]
        bounces = set(bounce_frames(item.pixels))
        mine = b.seg == c
        vm, am = mine & ~audio, mine & audio
        tp = b.pos[vm, 0].long()
        for p in tp.unique().tolist():
            sel = vm.clone()
            sel[vm] = tp == p
            video["y"].append(int(any(f in bounces for f in range(p * pt, p * pt + pt))))
            video["clip"].append(sid)
            for k, h in kept.items():
                hs = h[sel].float()
                video["X"][k].append(torch.cat([hs.mean(0), hs.amax(0), hs.amin(0)]).numpy())
        per_frame = item.audio.numel() / item.pixels.shape[1]  # samples a frame
        clicks = {int((f * per_frame + CLICK_OFFSET) // task.audio_patch) for f in bounces}
        n = int(am.sum())
        is_click = torch.tensor([j in clicks for j in range(n)], dtype=torch.bool)
        sound["y"].extend(is_click.int().tolist())
        a0, ah = x0[am, :width], x0_hat[am]  # this clip's sound: clean, and the model's x̂0
        for into, part in zip(sound["gain"], click_gain(a0, ah, is_click)):
            into.extend(part)
        m = a0.median(0).values
        sound["dev"].append(ah - m)
        sound["click_dev"].append(a0[is_click] - m)
        sound["place"].append(torch.arange(n) % round(pt * per_frame / task.audio_patch))
        sound["clip"].extend([sid] * n)
        for k, h in kept.items():
            sound["X"][k].extend(h[am].float().numpy())
    return video, sound


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve of `score` for binary labels `y` (Mann-Whitney, ties by order)."""
    rank = np.empty(len(score))
    rank[np.argsort(score, kind="stable")] = np.arange(len(score))
    pos = int(y.sum())
    neg = len(y) - pos
    return float((rank[y == 1].sum() - pos * (pos - 1) / 2) / (pos * neg)) if pos and neg else float("nan")


def probe(X: np.ndarray, y: np.ndarray, clips: np.ndarray, ridge: float = 10.0) -> float:
    """AUC on the odd clips of a ridge regression fitted on the even clips' standardised rows."""
    train = clips % 2 == 0
    mu, sd = X[train].mean(0), X[train].std(0) + 1e-6
    Xs = (X - mu) / sd
    A = Xs[train]
    w = np.linalg.solve(A.T @ A + ridge * np.eye(A.shape[1]), A.T @ (y[train] - y[train].mean()))
    return auc(Xs[~train] @ w, y[~train])


def probe_run(run: str | Path, clips: int, t: float = 1.0, seed: int = 0) -> dict:
    """{"video": [AUC per block], "audio": [...], counts} of a finished two-stream run (docstring above)."""
    cfg, model = load_run(run, ema=(Path(run) / "weights_ema.safetensors").exists())
    if getattr(cfg.model, "audio_patch", 0) <= 0:
        raise ValueError(f"{run} is not a two-stream run (model.audio_patch=0): there is no sound to probe")
    cond = copy.deepcopy(cfg.cond)
    cond.given_stream, cond.given_stream_prob = GivenStream.video, 1.0  # every clip with sound given its clean video
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cond)
    gen = torch.Generator().manual_seed(seed)
    items = ((i, task.dataset[i]) for i in range(len(task.dataset)))
    heard = ((i, item) for i, item in items if item.audio is not None)
    video = {"X": {}, "y": [], "clip": []}
    sound = {"X": {}, "y": [], "clip": [], "gain": ([], [], [], []), "dev": [], "place": [], "click_dev": []}
    done = 0
    while done < clips:
        pack = dict(i for _, i in zip(range(PACK), heard))
        if not pack:
            break
        parts = _features(task, model, pack, t, gen)
        for into, part in zip((video, sound), parts):
            for k, rows in part["X"].items():
                into["X"].setdefault(k, []).extend(rows)
            into["y"] += part["y"]
            into["clip"] += part["clip"]
        for gained, rows in zip(sound["gain"], parts[1]["gain"]):
            gained.extend(rows)
        for key in ("dev", "place", "click_dev"):
            sound[key] += parts[1][key]
        done += len(pack)
    mean = lambda v: float(np.mean(v)) if v else float("nan")  # noqa: E731
    along, energy, err_click, err_other = sound["gain"]
    out = {"clips": done, "patches": len(video["y"]), "bounces": sum(video["y"]), "tokens": len(sound["y"]),
           "clicks": sum(sound["y"]), "video": [], "audio": [],
           "click_gain": sum(along) / sum(energy) if energy else float("nan"),
           "error_click": mean(err_click), "error_other": mean(err_other),
           "places": _places(sound)}
    for k in sorted(video["X"]):
        for name, d in (("video", video), ("audio", sound)):
            out[name].append(probe(np.stack(d["X"][k]), np.asarray(d["y"]), np.asarray(d["clip"])))
    return out


def _places(sound: dict) -> list[tuple]:
    """place_gains of every probed audio token's x̂0 − m along the mean click."""
    if not sum(d.shape[0] for d in sound["click_dev"]):  # no click token probed: no mean click
        return []
    click = torch.cat(sound["click_dev"]).mean(0)
    along = torch.cat(sound["dev"]) @ click / (click @ click)
    return place_gains(along, torch.cat(sound["place"]), torch.tensor(sound["y"], dtype=torch.bool))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="a finished two-stream run (model.audio_patch > 0) on the embedded world with sound")
    ap.add_argument("--clips", type=int, default=600, help="clips with sound to probe (a few hundred: see above)")
    ap.add_argument("--t", type=float, default=1.0, help="the sound's noise level (1 = pure noise, where sampling starts)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.clips < 2 or not 0.0 <= a.t <= 1.0:
        ap.error("--clips must be >= 2 and --t in [0, 1]")
    r = probe_run(a.run, a.clips, a.t, a.seed)
    print(f"{a.run}, sound at t = {a.t}: {r['clips']} clips, {r['patches']} temporal patches ({r['bounces']} with a "
          f"bounce), {r['tokens']} audio tokens ({r['clicks']} clicks); AUC on the odd clips, 0.5 = chance")
    print("| block | video: a bounce in this temporal patch | audio: this token holds a click |")
    print("|---|---|---|")
    for k, (v, s) in enumerate(zip(r["video"], r["audio"])):
        print(f"| {k} | {v:.2f} | {s:.2f} |")
    if r["places"]:
        print(f"the sound's x̂0 at t = {a.t} along the mean click, per place in the temporal patch (1 = the click):")
        print("| place | click tokens (count) | other tokens (count) |")
        print("|---|---|---|")
        for p, hit, n_hit, miss, n_miss in r["places"]:
            print(f"| {p} | {hit:.3f} ({n_hit}) | {miss:.3f} ({n_miss}) |")
    print(f"the sound's x̂0 at t = {a.t}: click gain {r['click_gain']:.2f} (1 = the click, 0 = none); squared error "
          f"{r['error_click']:.3f} at the click tokens, {r['error_other']:.3f} elsewhere")


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
