"""summary.json: how a run ended, in strict JSON.

Rank 0's worker writes it when training ends (completed, failed or interrupted); the process
that started local workers corrects it afterwards when it knows the cause better (a killed or
frozen rank, where rank 0 only saw its collective fail; a signal to the launcher).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATUSES = ("completed", "failed", "interrupted")


def strict(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN / Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    """Write `<run_dir>/summary.json` whole or not at all: a reader never sees half of it, and a
    full disk must not leave it empty, truncated, or stale (an earlier segment's "completed").
    A failure to write is logged, not raised: the error that ends the run stays the one reported."""
    text = json.dumps(strict(summary), indent=2, allow_nan=False)
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name("summary.json.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
        return
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    try:  # no room for a second copy: drop the old one (its space too) and write in place
        path.unlink(missing_ok=True)
        path.write_text(text)
    except OSError as err:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        log.error("could not write %s: %s", path, err.strerror or err)


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The run's summary.json, or {} when there is none (or it cannot be read)."""
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def amend_summary(run_dir: str | Path, status: str, error: str) -> None:
    """Set the status and the error of the run's summary.json from the launching process; rank
    0's own account of the error, when it differs, is kept as "rank0_error". Writes a summary
    if no worker did (a worker killed before its end)."""
    assert status in STATUSES, status
    summary = read_summary(run_dir)
    seen = summary.get("error")
    if seen and seen != error:
        summary["rank0_error"] = seen
    summary.update(status=status, error=error)
    write_summary(run_dir, summary)
