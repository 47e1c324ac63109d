"""The suite's measured cost per test (tests/costs.tsv): what orders files under pytest-xdist and
what makes `-m "not slow"` a quick subset.

`tests/costs.tsv` holds each test's CPU seconds (pytest's process + its pool workers and
subprocesses) from a `--cpu-report` run of the whole suite, one `seconds<TAB>node id` a line.
Rewrite it from such a run's reports (under -n N, one FILE.gw<K> per worker) and from a
`-m "not slow"` run's: a test counts the most it cost in any of them.

    .venv/bin/python -m tests.costs /tmp/all.tsv.gw0 /tmp/all.tsv.gw1 /tmp/quick.tsv.gw0 /tmp/quick.tsv.gw1

A test pays for the module fixtures it is the first to use (a run, an oracle): in the whole
suite a slow test of its file paid them, in `-m "not slow"` it does itself, and the second
report marks it slow as well.

Two uses (tests/conftest.py):

- **Heaviest files first under `--dist loadfile`.** pytest-xdist hands a worker the next file
  when it has two tests left, in the order of its queue; by default that queue is sorted by the
  number of tests per file, so a heavy file of few tests (test_cli: 6 tests, 67 CPU-s) came last
  and ran alone on one core while the other had finished. Longest first, the files handed out
  last are the cheapest, and both workers end within about the cost of one small file.
- **`slow` for every test that measured SLOW_CPU_S or more**, besides the tests marked by hand.
  Most of the suite's CPU is in ~240 unmarked tests of 0.5-20 CPU-s each (fresh Pythons, W&B,
  compiles, calibrations): `-m "not slow"` took 636 CPU-s of the 1225.

Measured 2026-11-28 (docs/suite-costs.md): the 497 tests left by this table took 61 and 57 CPU-s
per xdist worker at load 5-7 (~6 of them starting and collecting); each round, the first quick
test of a file pays the module fixture a slow test paid in the whole suite (36 tests >= 0.5 in
that run), so a new `-m "not slow"` report always marks a few more.

A test missing from the table (new, renamed) counts DEFAULT_CPU_S for its file's order and is
not marked slow until the table is rewritten.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("costs.tsv")
SLOW_CPU_S = 0.5  # measured on the shared 2-core machine (10-20 % above quiet)
DEFAULT_CPU_S = 1.0  # about the suite's mean (1225 CPU-s / 976 tests)


def read_table(path: Path = TABLE) -> dict[str, float]:
    """{node id: CPU seconds} of tests/costs.tsv ({} without it)."""
    if not path.is_file():
        return {}
    costs = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            seconds, nodeid = line.split("\t", 1)
            costs[nodeid] = float(seconds)
    return costs


def order_files_by_cost(items: list, costs: dict[str, float]) -> None:
    """Reorder `items` in place: whole files, the costliest first; tests keep their order within
    a file (module fixtures, and tests that read what an earlier one of their file built)."""
    per_file: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        per_file[path] += costs.get(item.nodeid, DEFAULT_CPU_S)
        first.setdefault(path, i)
    items.sort(key=lambda item: (-per_file[item.nodeid.split("::", 1)[0]], first[item.nodeid.split("::", 1)[0]]))


def measured_slow(items: list, costs: dict[str, float]) -> list:
    """The items that measured SLOW_CPU_S or more."""
    return [item for item in items if costs.get(item.nodeid, 0.0) >= SLOW_CPU_S]


def parse_report(text: str) -> dict[str, float]:
    """{node id: CPU seconds} of a `--cpu-report` table (tests/cpu_report.py's format_table)."""
    costs = {}
    for line in text.splitlines():
        fields = line.split(None, 4)
        if len(fields) == 5 and "::" in fields[4]:
            costs[fields[4]] = float(fields[0])
    return costs


def write_table(reports: list[Path], path: Path = TABLE) -> int:
    costs: dict[str, float] = {}
    for report in reports:
        for nodeid, seconds in parse_report(report.read_text()).items():
            costs[nodeid] = max(costs.get(nodeid, 0.0), seconds)
    lines = [f"# CPU seconds per test, from `--cpu-report` ({', '.join(p.name for p in reports)}); "
             "python -m tests.costs REPORT... rewrites it (tests/costs.py)"]
    lines += [f"{costs[n]:.1f}\t{n}" for n in sorted(costs)]
    path.write_text("\n".join(lines) + "\n")
    return len(costs)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tests.costs REPORT [REPORT...]  (--cpu-report files; rewrites tests/costs.tsv)")
    print(f"{write_table([Path(a) for a in sys.argv[1:]])} tests -> {TABLE}")
