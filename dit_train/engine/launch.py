"""Starting workers.

- One process is enough (world = 1): train in this process.
- Already under torchrun (or our own agent): WORLD_SIZE/RANK are set; train in this process.
- Under SLURM through hydra-submitit-launcher: each task maps its SLURM rank to the same
  variables, then trains in this process.
- Otherwise, with world > 1: start `world` local workers with torch's elastic agent (the
  machinery behind torchrun), forked from a fork server that imported their modules once (see
  START_METHOD): one worker failing stops the others, the launcher exits
  non-zero, and with launcher.max_restarts > 0 all workers restart (resuming from the latest
  checkpoint when train.ckpt_every > 0).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dit_train.config import Config, LauncherConfig
from dit_train.config.errors import WorkerFailure
from dit_train.parallel.mesh import ParallelDims

log = logging.getLogger(__name__)


class Interrupted(KeyboardInterrupt):
    """A signal stopped the run (SIGTERM from a scheduler or `kill`, SIGINT from Ctrl-C, also
    when it reached the launcher of local workers): it ends like Ctrl-C, through the same
    `KeyboardInterrupt` paths (summary.json with status interrupted, one line, exit 128 + signal)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"stopped by {signal.Signals(self.signum).name}")


# The signal a handler saw, kept until it is reported: a raise that lands in a finalizer (a decord
# VideoReader's __del__ running at that moment) or in a C callback is printed as "Exception ignored"
# and lost, and a scheduler sends one SIGTERM before its SIGKILL. Inside a finalizer the handler does
# not raise at all (no traceback on stderr); poll points (`check_interrupted`, once per training step)
# raise what is pending, so the first signal always stops the run.
_pending: list[int] = []


def _raise_interrupted(signum: int, frame: Any) -> None:
    _pending.append(signum)
    if _in_finalizer(frame):  # raised there, Python prints "Exception ignored ..." and drops it: the poll raises it
        return
    raise Interrupted(signum)


def _in_finalizer(frame: Any) -> bool:
    """Whether the interrupted code runs inside a finalizer (`__del__`, at any depth)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def check_interrupted() -> None:
    """Raise `Interrupted` if a signal arrived whose exception was swallowed on its way (see
    `_pending`); a no-op otherwise. Called at safe points: each training step, each tool loop."""
    if _pending:
        raise Interrupted(_pending[0])


def run_stoppable(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), where an exception that arrives while a signal is pending is that signal's
    `Interrupted`: the signal's raise can land inside library code whose cleanup then fails on its
    half-done state (omegaconf's flag_override restoring flags on a half-built node raised an
    AttributeError that replaced the Interrupted): the stop must still end as a stop (status
    interrupted, one line, 143), not as a crash with exit 1."""
    try:
        return fn(*args)
    except Exception as err:
        if _pending:
            raise Interrupted(_pending[0]) from err
        raise


def interrupt_on_signals() -> None:
    """SIGTERM and SIGINT raise `Interrupted` in this process's main thread (SIGTERM would
    otherwise kill it before summary.json is written), and are remembered for
    `check_interrupted`. Call it from the main thread of a process that trains or launches workers."""
    if threading.current_thread() is threading.main_thread():
        _pending.clear()  # a new run or tool call in this process (tests, the session API) starts with none
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _raise_interrupted)


def interruption(err: KeyboardInterrupt) -> tuple[str, int]:
    """("stopped by SIGTERM", exit code 128 + the signal's number, as a shell reports a process
    the signal stopped: 143, or 130 for Ctrl-C)."""
    signum = err.signum if isinstance(err, Interrupted) else int(signal.SIGINT)
    _pending.clear()  # reported: the signal reached a handler that ends the work (a later call starts clean)
    return f"stopped by {signal.Signals(signum).name}", 128 + signum


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold a SIGTERM / SIGINT that arrives inside the block and handle it as usual (`Interrupted`)
    when the block ends: for work that must not be cut in half, such as an optimizer update with
    the bookkeeping that records it (a stop then saves a consistent state). A second signal is
    handled at once, wherever it lands. Only where `interrupt_on_signals` installed its handler
    (in the main thread); a no-op elsewhere."""
    sigs = (signal.SIGTERM, signal.SIGINT)
    handlers = {sig: signal.getsignal(sig) for sig in sigs}
    if threading.current_thread() is not threading.main_thread() or any(
            h is not _raise_interrupted for h in handlers.values()):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if held:  # asked twice: stop now
            handlers[signum](signum, frame)
        held.append(signum)

    for sig in sigs:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if held:
        handlers[held[0]](held[0], None)


def under_external_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def external_world_size() -> int | None:
    """Processes started by torchrun / SLURM, or None when this process is alone."""
    if under_external_launcher():
        return int(os.environ["WORLD_SIZE"])
    if "SUBMITIT_EXECUTOR" in os.environ and "SLURM_NTASKS" in os.environ:
        return int(os.environ["SLURM_NTASKS"])
    return None


def adopt_slurm_env() -> bool:
    """Inside a submitit/SLURM task: export RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    from the job environment (one task per GPU). Returns True if it did."""
    if "SUBMITIT_EXECUTOR" not in os.environ or "SLURM_PROCID" not in os.environ:
        return False
    import submitit  # deferred: optional (the slurm extra)

    env = submitit.JobEnvironment()
    nodes = env.hostnames
    os.environ.setdefault("MASTER_ADDR", nodes[0] if nodes else "localhost")
    # a port derived from the job id: every task of the job computes the same one
    os.environ.setdefault("MASTER_PORT", str(20000 + int(str(env.job_id).split("_")[0]) % 20000))
    os.environ["RANK"] = str(env.global_rank)
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    os.environ["WORLD_SIZE"] = str(env.num_tasks)
    os.environ["LOCAL_WORLD_SIZE"] = str(env.num_tasks // max(1, env.num_nodes))
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Heartbeat(threading.Thread):
    """In a worker: touch `<dir>/rank<RANK>` every `interval` seconds. A thread, so it beats
    while the main thread computes or waits in a collective, and stops only when the whole
    process does (frozen, SIGSTOP, swapped out): it tells a stuck rank from ranks waiting for it."""

    def __init__(self, beat_dir: str, interval: float = 2.0):
        super().__init__(daemon=True, name="heartbeat")
        self.path = Path(beat_dir) / f"rank{os.environ.get('RANK', '0')}"
        self.interval = interval

    def run(self) -> None:
        while True:
            try:
                self.path.write_text(str(os.getpid()))
            except OSError:
                return
            time.sleep(self.interval)


class Watchdog(threading.Thread):
    """In the launcher: a rank whose heartbeat is older than `timeout` seconds is killed
    (SIGKILL works on a stopped process too); the elastic agent then stops the others and
    restarts them (launcher.max_restarts) or fails. `stuck` records whom it stopped and why."""

    def __init__(self, beat_dir: str, timeout: float, interval: float = 1.0):
        super().__init__(daemon=True, name="watchdog")
        self.dir, self.timeout, self.interval = Path(beat_dir), timeout, interval
        self.stuck: dict[int, float] = {}
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            for f in self.dir.glob("rank*"):
                try:
                    age, pid = time.time() - f.stat().st_mtime, int(f.read_text() or 0)
                except (OSError, ValueError):
                    continue
                if age > self.timeout and pid > 0:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue  # already gone (the agent handles exits)
                    self.stuck[int(f.name[4:])] = age
                    log.error("worker rank %s (pid %d) showed no sign of life for %.0f s: stopping it", f.name[4:], pid, age)
                    f.unlink(missing_ok=True)

    def stop(self) -> None:
        self._stop.set()


# Local workers are forked from a fork server (multiprocessing's "forkserver") that imported the
# worker's modules once, not spawned: a spawned worker imports torch, torch.distributed's checkpoint
# stack, diffusers... anew (~5 CPU-s each, measured), so a 2-rank launch cost three imports and an
# 8-rank one nine; forked, it costs the server's one, and a restart (launcher.max_restarts) or a
# second launch from the same Python (the session API, a notebook) none. The server forks from a
# process that only imported modules (no thread, no OpenMP team, no CUDA context), so a worker
# starts as clean as a spawned one; multiprocessing hands it the launcher's cwd and sys.path.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

# The environment at this module's import. In a forked worker that is the fork server's environment
# when it started, which a long-lived launcher (pytest, a notebook) may have changed since: the
# worker puts back the launcher's environment of the launch (`env`, as spawn would give it) and keeps
# only what elastic set for its rank (RANK, WORLD_SIZE, MASTER_PORT...: the keys that differ).
_ENV_AT_IMPORT = dict(os.environ)


# What every training worker imports besides fn's module: FSDP2, DCP and torch._dynamo (torch's
# optimizers import it when the first one is built; with sympy and DTensor ~1.5-3 CPU-s); deferred
# in dit_train's modules so that a refused config or --help need not load them (docs/suite-costs.md)
_WORKER_MODULES = ["torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo"]


def _preload_for(fn: Callable[..., Any]) -> None:
    """Name the modules the fork server imports before it forks workers: this one, fn's and
    _WORKER_MODULES (a no-op once a server runs: its children import what they lack when they
    unpickle fn)."""
    module = getattr(getattr(fn, "func", fn), "__module__", None)
    own = [module] if module and module != "__main__" else []
    multiprocessing.set_forkserver_preload([__name__, *_WORKER_MODULES, *own])


def _launcher_env(env: dict[str, str]) -> None:
    """Make os.environ the launcher's `env` plus what elastic set for this rank (see _ENV_AT_IMPORT)."""
    rank_env = {k: v for k, v in os.environ.items() if _ENV_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(rank_env)


def _worker(fn: Callable[..., Any], args: tuple, beat_dir: str | None = None, env: dict[str, str] | None = None) -> Any:
    if env is not None:
        _launcher_env(env)
    interrupt_on_signals()  # the agent stops workers with SIGTERM: rank 0 still writes summary.json
    if beat_dir:
        Heartbeat(beat_dir).start()
    try:
        return run_stoppable(fn, *args)
    except KeyboardInterrupt as err:  # stopped on purpose: an exit code, not a traceback per worker
        raise SystemExit(interruption(err)[1]) from None
    except Exception as err:
        if _peer_failure(err):
            with contextlib.suppress(KeyboardInterrupt):  # the agent, having seen the dead peer, stops this rank
                time.sleep(PEER_GRACE_S)
        raise


# A collective that fails because a peer died (killed, out of memory) is a secondary error: this
# rank waits before exiting so that the agent sees the dead peer first and the run's one line names
# it. Without the wait the agent, polling every launcher.monitor_interval, could find both ranks
# dead at once and report the lowest (forked workers' exits reach it through the fork server, a few
# milliseconds later than a spawned child's): "rank 0 failed: Connection closed by peer" for a rank
# 1 killed by SIGKILL (seen once in a loaded clean-clone suite).
PEER_GRACE_S = 3.0
_PEER_WORDS = ("closed by peer", "reset by peer", "remote worker", "remote process exited")


def _peer_failure(err: BaseException) -> bool:
    """Whether err is a collective failing because another rank is gone (gloo: a RuntimeError
    "Connection closed by peer ... typically caused by a remote worker crashing")."""
    return isinstance(err, dist.DistError) or any(w in str(err) for w in _PEER_WORDS)


def launch_local(fn: Callable[..., Any], args: tuple, nproc: int, cfg: LauncherConfig) -> dict[int, Any]:
    """Run fn(*args) in `nproc` local processes with RANK/WORLD_SIZE/MASTER_* set.

    Returns {rank: return value}. Raises WorkerFailure if any worker fails or stops showing
    signs of life for launcher.heartbeat_timeout_s (after launcher.max_restarts restarts of the
    whole group); no worker outlives this call. Rendezvous listens on loopback only.
    """
    # elastic's warnings (a death signal received, workers being closed) repeat what our one line
    # says; each of its modules sets its own logger's level, so set each one's (its errors stay)
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.ERROR)
    port = cfg.master_port or free_port()
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"timeout": 120},
        run_id=f"dit_train_{uuid.uuid4().hex[:8]}", max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval, start_method=START_METHOD,
    )
    if START_METHOD == "forkserver":
        _preload_for(fn)
    beat_dir = tempfile.mkdtemp(prefix="dit_train_heartbeat_") if cfg.heartbeat_timeout_s > 0 else None
    watchdog = Watchdog(beat_dir, cfg.heartbeat_timeout_s) if beat_dir else None
    if watchdog is not None:
        watchdog.start()
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        return elastic_launch(lc, _worker)(fn, args, beat_dir, dict(os.environ))
    except SignalException as err:  # the agent caught SIGTERM / SIGINT and stopped the workers
        raise Interrupted(err.sigval) from None
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if watchdog is not None and watchdog.stuck:
            hung, age = next(iter(watchdog.stuck.items()))
            raise WorkerFailure(f"worker rank {hung} stopped making progress (no sign of life for {age:.0f} s: "
                                f"frozen, stopped or starved); all workers were stopped "
                                f"(launcher.heartbeat_timeout_s={cfg.heartbeat_timeout_s:g})") from None
        msg = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        raise WorkerFailure(failure_line(rank, failure.exitcode, msg)) from None
    finally:
        for sig, handler in handlers.items():  # the agent replaced them with its own
            signal.signal(sig, handler)
        if watchdog is not None:
            watchdog.stop()
            shutil.rmtree(beat_dir, ignore_errors=True)


def failure_line(rank: int, exitcode: int, message: str) -> str:
    """What a failed worker's line says. Elastic's stand-in message for a worker that left no error
    record ("To enable traceback see: <url>") is dropped; a worker ended by a signal from outside
    the run (128 + signal, or elastic's negative code and its "Signal 9 (SIGKILL) received by PID")
    is named by the signal and where it came from."""
    if message.startswith("To enable traceback see"):
        message = ""
    signum = exitcode - 128 if exitcode > 128 else -exitcode if exitcode < 0 else 0
    # elastic's own words for a signal: "Signal 9 (SIGKILL) received by PID 1234"
    if signum and (not message or message.startswith("Signal ")) and signum in signal.valid_signals():
        return (f"worker rank {rank} was stopped by {signal.Signals(signum).name} from outside the run (a scheduler, "
                f"the out-of-memory killer or kill; exit code {exitcode}); all workers were stopped")
    return f"worker rank {rank} failed (exit code {exitcode}): {message or 'see the traceback above'}"


def launch(cfg: Config, fn: Callable[[Config], Any]) -> Any:
    """Run `fn(cfg)` on as many processes as the layout needs; returns rank 0's result."""
    dims = ParallelDims.from_config(cfg.parallel)
    if dims.world == 1 or under_external_launcher() or adopt_slurm_env():
        return run_stoppable(fn, cfg)
    results = launch_local(fn, (cfg,), dims.world, cfg.launcher)
    return results.get(0)
