"""Loss curves and a final-loss table from a Hydra multirun (ablation sweep) directory.

    python -m dit_train -m optim.lr=1e-3,3e-3 loss.reduction=sample_mean,token_mean
    python -m dit_train.tools.plot_sweep multirun/2026-11-22/10-00-00

Writes <dir>/loss_curves.png and <dir>/summary.md (also printed): one row per job with its
overrides, final loss, mean loss of the last 10% of steps, and steps run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path



def job_label(job_dir: Path) -> str:
    overrides = job_dir / ".hydra" / "overrides.yaml"
    if overrides.exists():
        import yaml

        items = yaml.safe_load(overrides.read_text()) or []
        return " ".join(str(i) for i in items) or job_dir.name
    return job_dir.name


def collect(sweep_dir: Path) -> list[tuple[str, list[dict]]]:
    from dit_train.metrics import read_metrics

    jobs = []
    def job_number(p: Path):
        head = p.parent.name.split("_", 1)[0]
        return (0, int(head), "") if head.isdigit() else (1, 0, p.parent.name)

    for metrics in sorted(sweep_dir.glob("*/metrics.jsonl"), key=job_number):
        records = read_metrics(metrics)
        if records:
            jobs.append((job_label(metrics.parent), records))
    return jobs


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
    args = ap.parse_args(argv)
    jobs = collect(args.sweep_dir)
    if not jobs:
        print(f"no */metrics.jsonl under {args.sweep_dir}: is it a multirun directory?", file=sys.stderr)
        return 1

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    (args.sweep_dir / "summary.md").write_text(f"# Sweep {args.sweep_dir}\n\n![loss curves](loss_curves.png)\n\n{table}\n")
    print(table)
    print(f"\nwrote {png} and {args.sweep_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
