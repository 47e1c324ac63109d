"""What Hydra writes into a run folder, deferred until the folder is ours.

Hydra writes `.hydra/{config,hydra,overrides}.yaml` and opens `<job>.log` in the run dir
before our code runs, so a run refused on another run's folder used to overwrite that run's
`.hydra/` files. `conf/config.yaml` turns both off (`hydra.output_subdir: null`, and
`hydra/job_logging: dit_train`: the console only); `HydraRecord` keeps what they held and
`open_run_folder` writes it once the folder is claimed:

- `.hydra/config.yaml`, `.hydra/hydra.yaml`, `.hydra/overrides.yaml` as Hydra writes them
  (`tools.plot_sweep` reads the overrides of each sweep job);
- `<job>.log` (`__main__.log` for `python -m dit_train`): the launching process's log, from
  its start (the lines logged before the claim are kept in memory until then).

`CheckRunDir` (a Hydra callback) refuses a run dir that cannot be created with one line,
before Hydra's own mkdir fails with a traceback.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job log format


class _Buffer(logging.Handler):
    """The newest log records of this process, until the run folder is claimed (bounded: a rank
    that never claims one keeps only the last `capacity`)."""

    def __init__(self, capacity: int = 5000):
        super().__init__()
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class HydraRecord:
    """Hydra's run-folder files of this launch (name -> text) and the name of its job log."""

    files: dict[str, str]
    log_name: str
    buffer: _Buffer = field(default_factory=_Buffer)

    @classmethod
    def capture(cls, task_cfg: Any) -> "HydraRecord":
        """From inside the `@hydra.main` function: the composed task config it received; starts
        keeping this process's log records."""
        hydra = HydraConfig.get()
        files = {".hydra/config.yaml": OmegaConf.to_yaml(task_cfg),
                 ".hydra/hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra})),
                 ".hydra/overrides.yaml": OmegaConf.to_yaml(hydra.overrides.task)}
        record = cls(files, f"{hydra.job.name}.log")
        logging.getLogger().addHandler(record.buffer)
        return record

    def write(self, run_dir: Path) -> None:
        """Into the claimed run folder: the files, and the log (what was kept, then every new record)."""
        for name, text in self.files.items():
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_text(text)
        root = logging.getLogger()
        handler = logging.FileHandler(run_dir / self.log_name)
        handler.setFormatter(logging.Formatter(FORMAT))
        root.removeHandler(self.buffer)
        for rec in self.buffer.records:
            handler.handle(rec)
        self.buffer.records.clear()
        root.addHandler(handler)


def unusable_dir(path: Path) -> str:
    """Why `path` cannot be created or written ("" if it can), found without writing anything."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable ({existing}: permission denied)"
    return ""


class CheckRunDir(Callback):
    """Refuse, with one line, a hydra.run.dir that cannot be created or written (Hydra creates it
    before our code runs, and would fail with a traceback)."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        path = Path(str(config.hydra.run.dir)).absolute()
        problem = unusable_dir(path)
        if problem:
            print(f"error: run folder {path} {problem}; pick another hydra.run.dir or fix its permissions",
                  file=sys.stderr)
            sys.exit(1)
