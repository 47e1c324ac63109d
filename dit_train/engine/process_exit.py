"""Ending a command's process once its work is done, without CPython's teardown.

After a command has written and closed its files, CPython's finalization still frees every module
it imported (torch, diffusers, Hydra) object by object: ~0.9 s of CPU per launch on the 2-core
CI machine, and a multi-process run's fork server — a second Python with torch imported, started
by `engine.launch` — pays the same again after the launcher has exited, holding the caller's
stdout open until it has (a `| tee`, or a test reading the output, waits for it). A process
about to exit gains nothing from that work, so the command-line entry points end with
`exit_process`: what an exit must still do (finish non-daemon threads, run the atexit handlers —
logging's flush among them —, flush the standard streams), then `os._exit`.

Only for `python -m ...` entry points: in-process callers (tests, the session API, notebooks)
keep their interpreter.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing.forkserver as forkserver
import os
import signal
import sys
import threading
from typing import NoReturn


def exit_code(code: object) -> int:
    """The status `sys.exit(code)` would give: None is 0, an int itself, anything else printed
    to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def stop_fork_server() -> None:
    """Kill this process's idle multiprocessing fork server, if it started one.

    Called last, when every worker it forked has exited: it holds no work and no files of ours,
    and killing it spares its teardown (its own imports of torch and the worker modules). The
    server's pid sits in the module's private `_forkserver` (CPython 3.10–3.13): read with
    getattr, so another layout only skips the kill."""
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def exit_process(code: object = 0) -> NoReturn:
    """Exit with `code` (as `sys.exit` reads it) after what a normal exit does that matters
    here, skipping the interpreter's teardown of its modules."""
    status = exit_code(code)
    for thread in threading.enumerate():  # what Python's own shutdown waits for first
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 — CPython's own exit path; logging.shutdown is one of them
    stop_fork_server()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing left to say
            stream.flush()
    os._exit(status)


def run_and_exit(main, *args) -> NoReturn:  # noqa: ANN001 — a command's main(); its return is its status
    """`sys.exit(main(*args))` for a `python -m` entry point, ended by `exit_process`. An
    exception other than SystemExit propagates as usual (traceback, normal teardown)."""
    try:
        code = main(*args)
    except SystemExit as stop:
        code = stop.code
    exit_process(code)
