"""Run outputs of rank 0: metrics.jsonl, TensorBoard events and the progress bar."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


class MetricsLogger:
    """Writes one JSON object per optimizer step and mirrors scalars to TensorBoard.

    Only the main rank creates one (`enabled=False` elsewhere makes every call a no-op), so
    ranks never race on a file.
    """

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, enabled: bool = True,
                 progress: bool = True, log_every: int = 10):
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self._bar = None
        self._tb = None
        self._file = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        if start_step > 0 and path.exists():
            drop_rows_from(path, start_step)  # steps replayed after a resume are logged once
        # append: a resumed run continues the same file
        self._file = path.open("a", buffering=1)
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the events of steps >= start written by the interrupted run
        self._tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=start_step if start_step > 0 else None)
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(strict_json(record)) + "\n")
        step = record["step"]
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(k if "/" in k else f"train/{k}", v, step)  # eval/... keep their group
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):.0f}",
                                  gnorm=f"{record.get('grad_norm', float('nan')):.3f}", refresh=False)
        elif step % self.log_every == 0:
            print(f"step {step}: loss {record['loss']:.4f}  grad_norm {record.get('grad_norm', float('nan')):.3f}  "
                  f"{record.get('tokens_per_s', 0):.0f} tok/s", flush=True)

    @property
    def tensorboard(self):
        """The SummaryWriter (None on ranks other than the main one)."""
        return self._tb

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.enabled:
            self._tb.add_scalar(name, value, step)

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._tb.close()
        self._file.close()


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/Infinity: non-finite numbers become null and are listed under "nonfinite"."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


def drop_rows_from(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without the rows of steps >= `step` (atomic: a reader never sees half)."""
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a crash
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; for a step logged twice (a restart), the last one wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]
