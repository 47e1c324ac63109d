"""`pytest --cpu-report FILE`: the CPU seconds each test cost, its pool workers' included.

Wall time says little on a shared 2-core machine (a test beside a training run takes twice as
long and costs the same), so this records CPU time: for each test (setup, call and teardown) the
difference before/after of

- the test process itself and the children it has reaped (`resource.getrusage` SELF + CHILDREN:
  `run_cli`'s Pythons, torch elastic's workers once waited for), and
- every live descendant of it read from /proc/<pid>/stat, utime + stime + cutime + cstime: the
  fork server of tests/pool.py, the pools' gloo workers (children of the fork server, which
  reaps a replaced pool's workers into its own cutime) and any subprocess still running.

A process is counted once: while alive from its own stat, once reaped in its reaper's
cutime/cstime (or in our CHILDREN). A descendant that is born and reaped within one test by a
process that is itself born and gone within that test is counted through our CHILDREN. Time a
stopped (SIGSTOP) pool does not use is not charged to anyone.

The table, rewritten after each test and completed at the end of the session, lists tests by CPU seconds (highest first) with
their wall seconds, then the files' totals. Linux only (the option is refused elsewhere).
"""
from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its reaped children) from /proc/<pid>/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone between the listing and the read
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    # after the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
    return int(fields[1]), sum(int(f) for f in fields[11:15]) / _TICK


def descendants_cpu(root: int) -> float:
    """CPU seconds of every live descendant of `root` (not `root` itself), reaped children included."""
    procs = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            st = _stat(pid)
            if st is not None:
                procs[int(pid)] = st
    children = defaultdict(list)
    for pid, (ppid, _) in procs.items():
        children[ppid].append(pid)
    total, todo = 0.0, list(children[root])
    while todo:
        pid = todo.pop()
        total += procs[pid][1]
        todo.extend(children[pid])
    return total


def own_cpu() -> float:
    """CPU seconds of this process and the children it has waited for."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class CpuReport:
    def __init__(self, path: str):
        self.path = Path(path)
        self.rows: list[tuple[str, float, float, float]] = []  # nodeid, own CPU-s, descendants' CPU-s, wall s

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        me = os.getpid()
        own, desc, wall = own_cpu(), descendants_cpu(me), time.perf_counter()
        yield
        self.rows.append((item.nodeid, own_cpu() - own, descendants_cpu(me) - desc, time.perf_counter() - wall))
        # rewritten after every test (~1 ms): a run stopped by a timeout or Ctrl-C keeps what it measured
        self.path.write_text(format_table(self.rows))

    def pytest_sessionfinish(self, session):
        # the rest of the process's CPU: Python's start, imports, collection (before the first test)
        rest = own_cpu() + descendants_cpu(os.getpid()) - sum(r[1] + r[2] for r in self.rows)
        self.path.write_text(format_table(self.rows) + f"{rest:8.1f} {'':8} {'':6}  outside tests (start, imports, collection)\n")


def format_table(rows: list[tuple[str, float, float, float]]) -> str:
    lines = ["# CPU seconds per test (own = pytest's process + reaped children; workers = live descendants)",
             f"{'total':>8} {'own':>8} {'workers':>8} {'wall':>8}  test"]
    for nodeid, own, desc, wall in sorted(rows, key=lambda r: -(r[1] + r[2])):
        lines.append(f"{own + desc:8.1f} {own:8.1f} {desc:8.1f} {wall:8.1f}  {nodeid}")
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    for nodeid, own, desc, wall in rows:
        f = files[nodeid.split("::")[0]]
        f[0] += own + desc
        f[1] += wall
        f[2] += 1
        f[3] += own
    lines += ["", "# per file", f"{'CPU-s':>8} {'wall-s':>8} {'tests':>6}  file"]
    for name, (cpu, wall, n, _) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{cpu:8.1f} {wall:8.1f} {n:6d}  {name}")
    cpu = sum(r[1] + r[2] for r in rows)
    lines.append(f"{cpu:8.1f} {sum(r[3] for r in rows):8.1f} {len(rows):6d}  all")
    return "\n".join(lines) + "\n"
