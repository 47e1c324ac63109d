"""engine/process_exit.py: a command ends without the interpreter's teardown but with what an
exit must still do (threads finished, atexit handlers run, streams flushed, its status), and
its idle fork server is stopped, not left to tear itself down while holding the caller's stdout."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# A command's end as the entry points see it: a non-daemon thread still writing, an atexit
# handler, buffered output without a newline, then exit_process with a status.
_ENDING = """
import atexit, sys, threading, time
from pathlib import Path
from dit_train.engine.process_exit import exit_process

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
sys.stdout.write("buffered, no newline")
exit_process({code!r})
"""

# A fork server (as engine.launch starts one) whose teardown would leave a mark: only the server
# imports this module (its preload), and its forked children end with os._exit (no atexit).
_SERVER_MODULE = """
import atexit, os
from pathlib import Path
atexit.register(lambda: (Path(os.environ["MARK_DIR"]) / "server_teardown").write_text(str(os.getpid())))
"""
_SERVER = """
import multiprocessing as mp, sys
sys.path.insert(0, sys.argv[1])
from dit_train.engine.process_exit import exit_process

if __name__ == "__main__":
    mp.set_forkserver_preload(["server_mark"])
    p = mp.get_context("forkserver").Process(target=int)  # a builtin: the child needs nothing of this script
    p.start()
    p.join()
    exit_process(p.exitcode)
"""


def _run(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as in a pipe
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60, env=env)


def test_exit_process_keeps_what_an_exit_does(tmp_path):
    for code, status in ((3, 3), (None, 0), ("error: a message", 1)):
        out = tmp_path / str(status)
        out.mkdir()
        r = _run(textwrap.dedent(_ENDING.format(code=code)), str(out))
        assert r.returncode == status, r.stderr
        assert r.stdout == "buffered, no newline"
        assert (out / "atexit").read_text() == "ran" and (out / "thread").read_text() == "done"
        if isinstance(code, str):
            assert code in r.stderr


def test_the_fork_server_is_stopped_not_torn_down(tmp_path):
    (tmp_path / "server_mark.py").write_text(textwrap.dedent(_SERVER_MODULE))
    env = dict(os.environ, MARK_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    r = _run(textwrap.dedent(_SERVER), str(tmp_path), env=env)
    assert r.returncode == 0, r.stderr
    # the caller's pipe closed (run returned); a server that tore itself down would have left its mark
    assert not (tmp_path / "server_teardown").exists()
    # the mark works: a server ended by its own exit leaves it
    plain = textwrap.dedent(_SERVER).replace("exit_process(p.exitcode)", "sys.exit(p.exitcode)")
    assert _run(plain, str(tmp_path), env=env).returncode == 0
    assert (tmp_path / "server_teardown").exists()


def test_entry_points_end_with_exit_process():
    """Every `python -m` entry point of the package, and every script in tools/, ends through
    run_and_exit."""
    root = Path(__file__).resolve().parents[1] / "dit_train"
    missing = []
    for path in sorted([*root.rglob("*.py"), *(root.parent / "tools").glob("*.py")]):
        text = path.read_text()
        if 'if __name__ == "__main__":' in text and path.name != "__main__.py":
            tail = text.split('if __name__ == "__main__":', 1)[1]
            if "run_and_exit(main)" not in tail:
                missing.append(str(path.relative_to(root.parent)))
    assert not missing, missing
    main = (root / "__main__.py").read_text()
    assert "run_and_exit(cli)" in main and main.rstrip().endswith('if __name__ == "__main__":\n    entry()')
    assert 'dit-train = "dit_train.__main__:entry"' in (root.parent / "pyproject.toml").read_text()
