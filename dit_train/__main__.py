"""`python -m dit_train [overrides]` — the Hydra app.

Composes the config (strict: unknown keys fail), validates it, prepares the embedded data,
then trains on one process or starts the workers the layout needs. See README.md.
"""
from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dit_train.config import Config, register_configs


def run_from_config(cfg: Config) -> dict:
    """Validate, prepare data and train (in this process or in local workers)."""
    from dit_train.data import check_data, prepare_data
    from dit_train.launch import external_world_size, launch
    from dit_train.train import run
    from dit_train.validate import validate

    validate(cfg, external_world_size())
    prepare_data(cfg.mode, cfg.data)
    check_data(cfg)
    return launch(cfg, run)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> float | None:
    cfg: Config = OmegaConf.to_object(dcfg)
    cfg.run_dir = HydraConfig.get().runtime.output_dir
    from dit_train.launch import WorkerFailure
    from dit_train.validate import ConfigError

    try:
        summary = run_from_config(cfg)
    except (ConfigError, WorkerFailure) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    # returned to Hydra (sweepers such as Optuna minimise it)
    return summary.get("final_loss") if summary else None


def cli() -> None:
    register_configs()
    main()


if __name__ == "__main__":
    cli()
