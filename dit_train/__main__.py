"""`python -m dit_train [overrides]` (or `dit-train [overrides]`) — the Hydra app.

Composes the config (strict: unknown keys fail), checks it, prepares the data, then trains on
one process or starts the workers the layout needs. See README.md.
"""
from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dit_train.config import Config, config_dir, register_configs, to_config


def run_from_config(cfg: Config) -> dict:
    """Check the config, prepare and check the data, claim the run folder, then train (in this
    process or in local workers). Everything that can refuse the run happens before step 0."""
    import functools

    from dit_train.data import check_data, prepare_data
    from dit_train.engine.checks import ConfigError, check_config
    from dit_train.engine.launch import external_world_size, launch
    from dit_train.engine.run_folder import open_run_folder
    from dit_train.engine.worker import train

    check_config(cfg, external_world_size())
    try:
        prepare_data(cfg.data, cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    check_data(cfg)
    if external_world_size() is not None:  # torchrun / SLURM: rank 0 claims the folder in the worker
        return launch(cfg, train)
    folder = open_run_folder(cfg, cfg.train.resume)
    try:
        cfg.train.resume = str(folder.resume_from or "")  # every worker resumes from the same checkpoint
        return launch(cfg, functools.partial(train, claimed=True))
    finally:
        folder.release()


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> float | None:
    cfg = to_config(dcfg)
    cfg.run_dir = HydraConfig.get().runtime.output_dir
    from dit_train.checkpoint import CheckpointError
    from dit_train.engine.checks import ConfigError
    from dit_train.engine.launch import WorkerFailure
    from dit_train.engine.worker import RunFailed

    try:
        summary = run_from_config(cfg)
    except (ConfigError, WorkerFailure, RunFailed, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    # returned to Hydra (sweepers such as Optuna minimise it)
    return summary.get("final_loss") if summary else None


def cli() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        from dit_train.config.help import help_text

        print(help_text())
        return
    register_configs()
    main()


if __name__ == "__main__":
    cli()
