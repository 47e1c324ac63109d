"""The typed config tree: its schema (schema.py, choices.py), the errors that end a run
(errors.py), and the tree as YAML or plain data. Composing one from overrides or reading a
run's config.yaml needs every model's and data source's node: dit_train/compose.py."""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dit_train.config.choices import Choice, Mode
from dit_train.config.errors import ConfigError
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
    """The typed Config of a composed tree; a key the schema does not have is a ConfigError
    (Hydra's `+train.stpes=3`, the fix its own message suggests for a typo, adds the key to the
    node instead of refusing it, and the run would go on without the setting)."""
    cfg = OmegaConf.to_object(d)
    unknown = unknown_keys(cfg)
    if unknown:
        hints = [f"{k}{_did_you_mean(k, cfg)}" for k in unknown]
        raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: "
                          f"not in the schema (python -m dit_train --help lists the keys)", hints)
    return cfg


def unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted names of attributes of the config dataclasses that are not fields of their class."""
    if not dataclasses.is_dataclass(node):
        return []
    names = {f.name for f in dataclasses.fields(node)}
    out = [f"{prefix}{k}" for k in vars(node) if k not in names and not k.startswith("_")]
    for f in dataclasses.fields(node):
        out += unknown_keys(getattr(node, f.name), f"{prefix}{f.name}.")
    return out


def _did_you_mean(key: str, cfg: Any) -> str:
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = getattr(node, p)
    close = difflib.get_close_matches(leaf, [f.name for f in dataclasses.fields(node)], n=1)
    return f" (did you mean {'.'.join([*parents, close[0]])}?)" if close else ""


# The YAML of each config seen (by its repr: every field's value, nested), in this process: a run
# writes its config into its folder and checkpoints, a session into every save and export, ~0.05
# CPU-s each (OmegaConf's structured copy of the whole tree) against ~0.2 ms for the repr.
_YAML: dict[str, str] = {}


def to_yaml(cfg: Any) -> str:
    """`cfg` (a Config or any node of it) as YAML, as OmegaConf writes it."""
    key = repr(cfg)
    if key not in _YAML:
        if len(_YAML) >= 256:  # a long-lived process (a sweep, a notebook) keeps the recent ones
            _YAML.clear()
        _YAML[key] = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    return _YAML[key]


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (nested dicts, lists, strings for choices), e.g. for a tracker."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


__all__ = [
    "PARALLEL_DEGREES", "TRAIN_LAYOUT_KEYS", "Choice", "Config", "DataConfig", "LauncherConfig", "LoraConfig", "LossConfig", "MoEConfig", "Mode",
    "DistillConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "VideoModelConfig", "config_dir",
    "parallel_layout_keys", "to_config", "to_dict", "to_yaml",
]
