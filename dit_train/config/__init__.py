"""The typed config tree: its schema (schema.py, choices.py), the errors that end a run
(errors.py), and the tree as YAML or plain data. Composing one from overrides or reading a
run's config.yaml needs every model's and data source's node: dit_train/compose.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dit_train.config.choices import Choice, Mode
from dit_train.config.schema import (
    PARALLEL_DEGREES,
    TRAIN_LAYOUT_KEYS,
    Config,
    DataConfig,
    LauncherConfig,
    LoraConfig,
    MoEConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    DistillConfig,
    VideoModelConfig,
    parallel_layout_keys,
)


def config_dir() -> Path:
    """The conf/ tree: shipped inside the package (`dit_train/conf`, a link to the top-level
    `conf/` in the source tree, copied into wheels), so any install finds it from any directory."""
    return Path(__file__).resolve().parents[1] / "conf"


def to_config(d: DictConfig) -> Config:
    return OmegaConf.to_object(d)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (nested dicts, lists, strings for choices), e.g. for a tracker."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


__all__ = [
    "PARALLEL_DEGREES", "TRAIN_LAYOUT_KEYS", "Choice", "Config", "DataConfig", "LauncherConfig", "LoraConfig", "LossConfig", "MoEConfig", "Mode",
    "DistillConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "VideoModelConfig", "config_dir",
    "parallel_layout_keys", "to_config", "to_dict", "to_yaml",
]
