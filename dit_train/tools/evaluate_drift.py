"""The drift measurement of tools.evaluate: a block-causal run's held-out captions streamed past
its training length, scored window by window (docs/causal.md#the-drift-measurement).

    python -m dit_train.tools.evaluate RUN --heldout --frames 32 --overlap-frames 4

tools.evaluate samples the clips through tools.sample (the streaming sampler with its KV cache
and sliding window: no second sampler here); this module checks the request before anything
runs, scores each WINDOW-frame window of every clip (data_pipelines/shapes_drift.py), scores
rendered long clips of the same compositions and sizes the same way (the ceiling: what a model
that never drifts reaches), and draws the figures against the window index and a grid of a few
whole clips.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from safetensors.torch import load_file

from dit_train.data_pipelines.shapes_drift import WINDOW, score_windows, window_means
from dit_train.data_pipelines.synthetic_video import render_long_clip
from dit_train.sampling.outputs import frame_grid, to_uint8_frames
from dit_train.sampling.streaming import stream_check

GRID_CLIPS = 6  # whole clips in drift_grid.png
PLOTTED = ("all_ok", "kept", "color_ok", "shape_ok", "background_ok", "single_shape", "moving_ok")


def is_drift(args: argparse.Namespace) -> bool:
    """Whether the evaluation is the drift measurement: clips longer than one scored window."""
    return args.frames > WINDOW


def check_drift(args: argparse.Namespace, cfg: Any) -> None:
    """ValueError (one `error:` line) for a drift request that cannot run, before anything is
    sampled: not the held-out captions, a bidirectional run, a length off the windows or the
    blocks, or a window tools.sample cannot slide (stream_check, its own check)."""
    k = int(getattr(cfg.model, "causal_block_frames", 0) or 0)
    if args.train_captions:
        raise ValueError(f"--frames {args.frames} streams the held-out compositions past the training length: drop "
                         f"--train-captions (the training clips have their own lengths)")
    if not k:
        raise ValueError(f"--frames {args.frames} measures the drift of a block-causal run streaming past its training "
                         f"length (model.causal_block_frames > 0); {args.run_dir} is bidirectional: drop --frames "
                         f"(it is scored at {WINDOW} frames)")
    if args.frames % WINDOW:
        low = args.frames - args.frames % WINDOW
        raise ValueError(f"--frames {args.frames} is not a whole number of {WINDOW}-frame windows (each is scored on "
                         f"its own): use {low} or {low + WINDOW}")
    why = stream_check(args.frames, k, int(getattr(cfg.data, "max_frames", 0) or 0), args.overlap_frames)
    if why is not None:
        raise ValueError(why)


def drift_report(out: Path, captions: list[str], frames: int) -> dict:
    """Score the sampled clips of `out` (tools.sample's samples.safetensors, keys prompt_<i>_0 in
    caption order) window by window, and rendered clips of the same captions and size as the
    reference; write drift.png and drift_grid.png; return the JSON's drift part."""
    samples = load_file(str(out / "samples.safetensors"))
    clips = [samples[f"prompt_{i}_0"] for i in range(len(captions))]
    height, width = clips[0].shape[-2:]
    scored = [score_windows(c, p) for c, p in zip(clips, captions)]
    reference = [score_windows(render_long_clip(p, frames, height, width, index=i), p) for i, p in enumerate(captions)]
    windows, ceiling = window_means(scored), window_means(reference)
    spans = [f"{k * WINDOW + 1}-{(k + 1) * WINDOW}" for k in range(frames // WINDOW)]
    _plot(out / "drift.png", windows, ceiling, spans)
    shown = [to_uint8_frames(c.float()) for c in clips[:GRID_CLIPS]]
    Image.fromarray(frame_grid(shown, captions[:GRID_CLIPS], max_cols=frames)).save(out / "drift_grid.png")
    return {"window_frames": WINDOW,
            "windows": [{"frames": s, **w} for s, w in zip(spans, windows)],
            "reference_windows": [{"frames": s, **w} for s, w in zip(spans, ceiling)],
            "clips": [{"caption": p, "all_ok": [w["all_ok"] for w in s], "kept": [w["kept"] for w in s]}
                      for p, s in zip(captions, scored)],
            "plot": str(out / "drift.png"), "drift_grid": str(out / "drift_grid.png")}


def _plot(path: Path, windows: list[dict], ceiling: list[dict], spans: list[str]) -> None:
    """Each figure against the window index; the rendered clips' all_ok dashed (the ceiling)."""
    import matplotlib  # deferred: only the drift measurement plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred with matplotlib above

    x = np.arange(1, len(windows) + 1)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key in PLOTTED:
        ax.plot(x, [w[key] for w in windows], marker="o", label=key, linewidth=2.5 if key == "all_ok" else 1.2)
    ax.plot(x, [w["all_ok"] for w in ceiling], "k--", label="all_ok, rendered clips")
    ax.set_xticks(x, [f"{k}\n({s})" for k, s in zip(x, spans)])
    ax.set_xlabel("window (frames)")
    ax.set_ylabel("share of clips")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def drift_line(drift: dict) -> str:
    """One printed line: all_ok and kept by window, the rendered clips' all_ok beside them."""
    def by_window(rows: list[dict], key: str) -> str:
        return " ".join(f"{r[key]:.2f}" for r in rows)
    return (f"by {drift['window_frames']}-frame window: all_ok {by_window(drift['windows'], 'all_ok')} "
            f"(rendered clips {by_window(drift['reference_windows'], 'all_ok')}), "
            f"kept {by_window(drift['windows'], 'kept')}")
