"""What starting local workers costs: spawned fresh Pythons against workers forked from a fork
server (engine/launch.py's START_METHOD), for a 2-step tiny run (docs/layouts.md, "Launching").

Usage: python benchmarks/launch_cost.py [WORLDS...]   (default 2 4; ~1 min on 2 cores)

Each row runs `python -m dit_train` with the suite's tiny model and clips (tests/conftest.py TINY,
train.steps=2, parallel.dp_shard=N) as a child of this process, which makes itself a child
subreaper (prctl PR_SET_CHILD_SUBREAPER, Linux) so that the fork server and its workers, orphaned
when the launcher exits, are reaped here and their CPU counted in RUSAGE_CHILDREN. Prints the CPU
seconds (user + system, every process) and wall seconds per start method, and their ratio."""
from __future__ import annotations

import ctypes
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.conftest's TINY, its dit_train


def _run_as_launcher(method: str, args: list[str]) -> None:
    """In the child: `python -m dit_train ARGS` with engine.launch.START_METHOD = method."""
    import dit_train.engine.launch as launch

    launch.START_METHOD = method
    sys.argv = ["dit_train", *args]
    runpy.run_module("dit_train", run_name="__main__", alter_sys=True)


def measure(method: str, world: int, cache: str) -> tuple[float, float]:
    """(CPU-s of every process the run started, wall s)."""
    from tests.conftest import TINY

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_dir = tempfile.mkdtemp(prefix="launch_cost_")
    args = [*TINY, "train.steps=2", f"parallel.dp_shard={world}", f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", method, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: the {method} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    while True:  # the orphans (a fork server and its workers) were reparented to us
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), wall


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _run_as_launcher(sys.argv[2], sys.argv[3:])
        return
    if not sys.platform.startswith("linux"):
        sys.exit("error: benchmarks/launch_cost.py counts orphaned processes through a Linux child subreaper")
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    worlds = [int(w) for w in sys.argv[1:]] or [2, 4]
    cache = tempfile.mkdtemp(prefix="launch_cost_cache_")
    measure("forkserver", 1, cache)  # prepares the clips' cache once, outside the table
    print(f"{'workers':>7}  {'spawn CPU-s':>11}  {'fork server CPU-s':>17}  {'ratio':>5}  {'spawn wall':>10}  {'fork server wall':>16}")
    for world in worlds:
        (cs, ws), (cf, wf) = measure("spawn", world, cache), measure("forkserver", world, cache)
        print(f"{world:>7}  {cs:>11.1f}  {cf:>17.1f}  {cs / cf:>5.2f}  {ws:>10.1f}  {wf:>16.1f}")


if __name__ == "__main__":
    main()
