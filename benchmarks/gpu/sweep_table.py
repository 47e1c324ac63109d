"""The table of benchmarks/gpu/sweep.sh: per run its steps and training seconds, and per
evaluation (RUN/eval/*/evaluate.json) the picture's and the sound's figures.

    python benchmarks/gpu/sweep_table.py /tmp/gpu_sweep_runs
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

FIGURES = ("color_ok", "shape_ok", "motion_ok", "all_ok", "sound_color_ok", "sound_sync_ok", "sound_sync_bounced",
           "sound_clicking_clips")


def rows(runs: Path) -> list[str]:
    out = [f"{'run':22s} {'steps':>5s} {'s':>5s} {'eval':28s} " + " ".join(f"{f[:13]:>13s}" for f in FIGURES)]
    for d in sorted(p for p in runs.iterdir() if p.is_dir()):
        metrics = d / "metrics.jsonl"
        m = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        steps = max((r.get("step", 0) for r in m), default=0)
        secs = sum(r.get("step_time_s", 0) for r in m)
        for e in sorted((d / "eval").glob("*/evaluate.json")):
            row = json.loads(e.read_text())
            flags = row.get("which", "") + (" given_video" if row.get("given_video") else "")
            s = row.get("scores", {})
            out.append(f"{d.name:22s} {steps:5d} {secs:5.0f} {flags:28s} "
                       + " ".join(f"{s[f]:13.2f}" if f in s else f"{'':13s}" for f in FIGURES))
    return out


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]))))
