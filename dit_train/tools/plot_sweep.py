"""Loss curves and a final-loss table from a Hydra multirun (ablation sweep) directory.

    python -m dit_train -m optim.lr=1e-3,3e-3 loss.reduction=sample_mean,token_mean
    python -m dit_train.tools.plot_sweep multirun/2026-11-22/10-00-00

Writes <dir>/loss_curves.png and <dir>/summary.md (also printed): one row per job with its
overrides, final loss, mean loss of the last 10% of steps, and steps run. When the jobs logged
quality figures (validation on the embedded world: eval/... in metrics.jsonl), also
<dir>/quality.png: each --metrics figure over steps, one panel row per kind of sample (images,
videos, or all when the data has one kind), a line per job, and their last values in the table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from dit_train.metrics import read_metrics



def job_overrides(job_dir: Path) -> list[str]:
    overrides = job_dir / ".hydra" / "overrides.yaml"
    if overrides.exists():
        return [str(i) for i in yaml.safe_load(overrides.read_text()) or []]
    return []


def job_labels(job_dirs: list[Path]) -> list[str]:
    """Each job's overrides without those every job shares (the sweep's axes are what differs:
    `loss.reduction=token_mean`, not the experiment and flags given to the whole sweep)."""
    items = [job_overrides(d) for d in job_dirs]
    common = set.intersection(*map(set, items)) if len(items) > 1 else set()
    return [" ".join(i for i in its if i not in common) or d.name for its, d in zip(items, job_dirs)]


def collect(sweep_dir: Path) -> list[tuple[str, list[dict]]]:
    jobs = []
    def job_number(p: Path):
        head = p.parent.name.split("_", 1)[0]
        return (0, int(head), "") if head.isdigit() else (1, 0, p.parent.name)

    for metrics in sorted(sweep_dir.glob("*/metrics.jsonl"), key=job_number):
        records = read_metrics(metrics)
        if records:
            jobs.append((metrics.parent, records))
    return list(zip(job_labels([d for d, _ in jobs]), [r for _, r in jobs]))


def smooth(values: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--smooth", type=int, default=10, help="moving-average window of the plotted curves")
    ap.add_argument("--metrics", default="color_ok,shape_ok,all_ok",
                    help="quality figures to plot (eval/<kind>/<name> in metrics.jsonl)")
    args = ap.parse_args(argv)
    jobs = collect(args.sweep_dir)
    if not jobs:
        print(f"no */metrics.jsonl under {args.sweep_dir}: is it a multirun directory?", file=sys.stderr)
        return 1

    import matplotlib  # deferred: only plotting needs matplotlib (~0.5 s)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: only plotting needs matplotlib (~0.5 s)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    rows = ["| job | final loss | mean of last 10% | steps |", "|---|---:|---:|---:|"]
    for label, recs in jobs:
        steps = [r["step"] for r in recs]
        losses = [r["loss"] for r in recs]
        ax.plot(steps, smooth(losses, args.smooth), label=label, linewidth=1.5)
        tail = losses[-max(1, len(losses) // 10):]
        rows.append(f"| {label} | {losses[-1]:.4f} | {sum(tail) / len(tail):.4f} | {len(recs)} |")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"loss (moving average, {args.smooth} steps)")
    ax.set_title(f"{args.sweep_dir}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = args.sweep_dir / "loss_curves.png"
    fig.savefig(png, dpi=120)
    table = "\n".join(rows)
    quality = plot_quality(jobs, args.sweep_dir, args.metrics.split(","), plt)
    body = f"# Sweep {args.sweep_dir}\n\n![loss curves](loss_curves.png)\n\n{table}\n"
    if quality:
        body += f"\n![quality](quality.png)\n\n{quality}\n"
    (args.sweep_dir / "summary.md").write_text(body)
    print(table + (f"\n\n{quality}" if quality else ""))
    print(f"\nwrote {png}{' and quality.png' if quality else ''} and {args.sweep_dir / 'summary.md'}")
    return 0


def plot_quality(jobs: list[tuple[str, list[dict]]], out_dir: Path, metrics: list[str], plt) -> str:
    """quality.png (a panel per kind x metric) and a markdown table of the last values; '' when
    no job logged quality figures."""
    evals = [(label, [r for r in recs if any(k.startswith("eval/") for k in r)]) for label, recs in jobs]
    if not any(rs for _, rs in evals):
        return ""
    keys = {k for _, rs in evals for r in rs for k in r}
    kinds = [k for k in ("image", "video") if any(x.startswith(f"eval/{k}/") for x in keys)] or [""]
    fig, axes = plt.subplots(len(kinds), len(metrics), figsize=(4 * len(metrics), 3.2 * len(kinds)), squeeze=False)
    head = [f"{kind or 'all'} {m}" for kind in kinds for m in metrics]
    rows = ["| job | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for label, rs in evals:
        last = []
        for i, kind in enumerate(kinds):
            for j, m in enumerate(metrics):
                key = f"eval/{kind}/{m}" if kind else f"eval/{m}"
                pts = [(r["step"] + 1, r[key]) for r in rs if r.get(key) is not None]
                if pts:
                    axes[i][j].plot(*zip(*pts), marker="o", markersize=3, label=label)
                last.append(f"{pts[-1][1]:.2f}" if pts else "–")
                axes[i][j].set_title(f"{kind or 'all'} samples: {m}", fontsize=9)
                axes[i][j].set_xlabel("step")
                axes[i][j].set_ylim(-0.02, 1.02)
                axes[i][j].grid(alpha=0.3)
        rows.append(f"| {label} | " + " | ".join(last) + " |")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(labels) - 1) // 3), 1, 1))  # room for the legend below
    fig.savefig(out_dir / "quality.png", dpi=110)
    return "\n".join(rows)


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
