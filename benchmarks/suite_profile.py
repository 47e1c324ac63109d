"""Where the suite's CPU time goes, by function, across every Python process it starts.

`pytest --cpu-report` (tests/cpu_report.py) says which *tests* cost CPU; this says which
*functions* do, in the pytest workers, the pools' fork servers and gloo workers, and every fresh
`python -m dit_train` a test starts: each Python samples its own main thread's stack every
20 ms of its CPU time (ITIMER_PROF, restarted in forked children), through a sitecustomize on
PYTHONPATH that the suite's processes inherit. Stacks go to one file per process; this script
then prints the functions by inclusive and self CPU-seconds, and named categories.

    .venv/bin/python benchmarks/suite_profile.py --out /tmp/suite_prof -- -q -n 2 --dist loadfile tests
    .venv/bin/python benchmarks/suite_profile.py --out /tmp/suite_prof --report-only   # read it again

Caveats: a sample lands on the Python frame that runs when the signal is handled, so time in a
long C call counts to the frame that made it (or, in autograd's backward, to the next Python
backward called); threads other than the main one are not sampled. The SIGPROF signals fail a
few tests that compile with inductor or time their subprocesses (7 of 1093 on 2026-11-28): a
profile, not a test run.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HZ = 50

SITECUSTOMIZE = '''
import atexit, collections, os, signal
_OUT, _HZ, _counts, _n = {out!r}, {hz}, collections.Counter(), [0]

def _key(frame):
    parts = []
    while frame is not None:
        code = frame.f_code
        parts.append(f"{{code.co_name}} ({{code.co_filename.split('site-packages/')[-1]}})")
        frame = frame.f_back
    return ";".join(reversed(parts))

def _flush():
    if _counts:
        try:
            with open(os.path.join(_OUT, f"{{os.getpid()}}.txt"), "a") as f:
                f.writelines(f"{{k}} {{v}}\\n" for k, v in _counts.items())
        except OSError:
            pass
        _counts.clear()

def _sample(sig, frame):
    _counts[_key(frame)] += 1
    _n[0] += 1
    if _n[0] % 100 == 0:  # pool workers end by SIGKILL: flush as they go
        _flush()

def _start():
    _counts.clear()
    _n[0] = 0
    signal.signal(signal.SIGPROF, _sample)
    signal.setitimer(signal.ITIMER_PROF, 1.0 / _HZ, 1.0 / _HZ)

_start()
os.register_at_fork(after_in_child=_start)

def _stop():  # the timer would go on firing through the interpreter's teardown (SIGPROF's default: terminate)
    signal.setitimer(signal.ITIMER_PROF, 0, 0)
    _flush()

atexit.register(_stop)
'''

# inclusive CPU-seconds of the stacks holding a frame whose name starts with one of the patterns
CATEGORIES = {
    "training steps (Trainer.step)": ("step (dit_train/engine/trainer.py)",),
    "building runs (build_run)": ("build_run (dit_train/engine/build.py)",),
    "composing configs (dit_train.compose)": ("compose (dit_train/compose.py)",),
    "imports": ("_find_and_load (<frozen importlib._bootstrap>)",),
    "FSDP2's hooks (gathers before forward/backward, reduce after)": tuple(
        f"{name} (torch/distributed/fsdp/_fully_shard/" for name in (
            "_pre_forward", "_post_forward", "_pre_backward", "post_backward", "_root_post_backward_final_callback")),
    "FSDP2 wrapping (fully_shard)": ("fully_shard (torch/distributed/fsdp/_fully_shard/_fully_shard.py)",),
    "torch.compile (dynamo's frame conversion)": ("_compile (torch/_dynamo/convert_frame.py)",),
    "reading clips (read_frames)": ("read_frames (dit_train/data_pipelines/video_io.py)",),
    "writing the embedded set (ensure_synthetic_videos)": ("ensure_synthetic_videos (",),
    "checkpoints (save_checkpoint)": ("save_checkpoint (dit_train/checkpoint/store.py)",),
    "run folders (open_run_folder)": ("open_run_folder (dit_train/engine/run_folder.py)",),
    "validation samples (Validation.__call__)": ("__call__ (dit_train/engine/validation.py)",),
}

def read(out: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for path in out.glob("*.txt"):
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if n.isdigit():
                stacks.append((re.sub(r"/\S*/lib/python3\.\d+/", "", stack).split(";"), int(n)))
    return stacks


def report(out: Path, top: int) -> None:
    stacks = read(out)
    total = sum(n for _, n in stacks)
    if not total:
        sys.exit(f"error: no samples under {out}: run the suite with this script first")
    own, incl, cats = collections.Counter(), collections.Counter(), collections.Counter()
    for frames, n in stacks:
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
        for name, patterns in CATEGORIES.items():
            if any(f.startswith(patterns) for f in frames):
                cats[name] += n
    print(f"{total / HZ:.1f} CPU-s sampled in {len(list(out.glob('*.txt')))} processes\n")
    print("| category (inclusive; they overlap) | CPU-s | share |\n|---|---|---|")
    for name, n in cats.most_common():
        print(f"| {name} | {n / HZ:.1f} | {n / total:.1%} |")
    for title, counter in (("inclusive", incl), ("self", own)):
        print(f"\n{title} CPU-s, top {top}:")
        for frame, n in counter.most_common(top):
            print(f"{n / HZ:8.1f}  {frame}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the per-process stack files")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--report-only", action="store_true", help="print the report of an earlier --out")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="suite_profile_"))
    if not args.report_only:
        code = profile([sys.executable, "-m", "pytest", *(args.pytest_args or ["-q", "tests"])], out)
        print(f"pytest exited {code}; stacks in {out}\n")
    report(out, args.top)


def profile(cmd: list[str], out: Path) -> int:
    """Run `cmd` with every Python it starts sampling its stacks into `out`; its exit status."""
    out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="suite_profile_site_"))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(out=str(out), hz=HZ))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    main()
