"""`python -m dit_train [overrides]` (or `dit-train [overrides]`) — the Hydra app.

Composes the config (strict: unknown keys fail), checks it, prepares the data, then trains on
one process or starts the workers the layout needs. See README.md.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dit_train.checkpoint import checkpoint_root, list_checkpoints
from dit_train.config import Config, config_dir, to_config
from dit_train.compose import register_configs
from dit_train.config.errors import CheckpointError, ConfigError, RunFailed, WorkerFailure
from dit_train.data_pipelines import prepare_data
from dit_train.distill.build import build_distill_run, student_config
from dit_train.engine.checks import check_config
from dit_train.engine.hydra_outputs import HydraRecord
from dit_train.engine.launch import external_world_size, interrupt_on_signals, interruption, launch
from dit_train.engine.process_exit import run_and_exit
from dit_train.engine.run_folder import open_run_folder
from dit_train.engine.summary import amend_summary
from dit_train.engine.worker import train
from dit_train.help import help_text
from dit_train.tasks import checked_data, resolve_config


def run_from_config(cfg: Config, hydra_record: Any = None) -> dict:
    """Check the config, prepare and check the data, claim the run folder, then train (in this
    process or in local workers). Everything that can refuse the run happens before step 0.
    hydra_record: the CLI's `HydraRecord`, written into the run folder once it is claimed."""
    cfg = student_config(cfg)  # distill.teacher: the teacher run's model and data keys (dit_train/distill)
    check_config(cfg, external_world_size())
    try:
        prepare_data(cfg.data, cfg.model)
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from err
    lengths, data = checked_data(cfg)
    cfg = resolve_config(cfg, lengths)  # the run's config (auto budget resolved): read, never changed, from here on
    # a distillation run builds three models (dit_train/distill); the worker takes the builder
    build = {"build": build_distill_run} if cfg.distill.method != "none" else {}
    if external_world_size() is not None:  # torchrun / SLURM: rank 0 claims the folder in the worker
        return launch(cfg, functools.partial(train, hydra_record=hydra_record, data=data, **build))
    folder = open_run_folder(cfg, cfg.train.resume, hydra_record, data)
    try:
        # every worker resumes from the checkpoint the folder was claimed with
        resumed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(folder.resume_from or "")))
        return launch(resumed, functools.partial(train, claimed=True, **build))
    except WorkerFailure as err:  # rank 0 may only have seen its collective fail: name the real cause
        amend_summary(folder.path, "failed", f"WorkerFailure: {err}")
        raise
    except KeyboardInterrupt as err:  # a signal to this process (the workers got it from the agent)
        amend_summary(folder.path, "interrupted", f"Interrupted: {interruption(err)[0]}")
        raise
    finally:
        folder.release()


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> float | None:
    interrupt_on_signals()  # a scheduler's SIGTERM ends the run like Ctrl-C
    record = HydraRecord.capture(dcfg)  # Hydra's .hydra/ files and job log, written once the folder is ours
    try:
        cfg = dataclasses.replace(to_config(dcfg), run_dir=HydraConfig.get().runtime.output_dir)
    except ConfigError as err:  # a key the schema lacks (`+train.stpes=3`)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    try:
        summary = run_from_config(cfg, record)
    except (ConfigError, WorkerFailure, RunFailed, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as err:
        print(f"error: {interrupted_line(err, cfg)}", file=sys.stderr)
        sys.exit(interruption(err)[1])
    # returned to Hydra (sweepers such as Optuna minimise it)
    return summary.get("final_loss") if summary else None


def interrupted_line(err: KeyboardInterrupt, cfg: Config) -> str:
    """What a stopped run tells its user: which signal, where its summary is, how to go on."""
    run = Path(cfg.run_dir)
    how = interruption(err)[0]
    saved = list_checkpoints(checkpoint_root(run)) if (run / "summary.json").exists() else []
    then = (f"continue with train.resume=auto (newest checkpoint: {saved[-1][1].name})" if saved
            else "no checkpoint to continue from (train.ckpt_every=0 or none written yet)")
    where = f"status in {run / 'summary.json'}" if (run / "summary.json").exists() else f"run folder {run}"
    return f"the run was {how} ({where}); {then}"


def cli() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(help_text())
        return
    register_configs()
    main()


def entry() -> None:
    """The `python -m dit_train` / `dit-train` entry point: cli(), then the process ends
    (engine/process_exit.py). In-process callers call cli(), which returns."""
    run_and_exit(cli)


if __name__ == "__main__":
    entry()
