"""The typed config tree: its schema (schema.py, choices.py), the errors that end a run
(errors.py), and the tree as YAML or plain data. Composing one from overrides or reading a
run's config.yaml needs every model's and data source's node: dit_train/compose.py."""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_omega_conf_dumper

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
# writes its config into its folder and checkpoints, a session into every save and export.
_YAML: dict[str, str] = {}


def to_yaml(cfg: Any) -> str:
    """`cfg` (a Config or any node of it) as YAML, as OmegaConf writes it
    (`OmegaConf.to_yaml(OmegaConf.structured(cfg))`, byte for byte: tests/test_config.py checks
    every option and experiment)."""
    key = repr(cfg)
    if key not in _YAML:
        if len(_YAML) >= 256:  # a long-lived process (a sweep, a notebook) keeps the recent ones
            _YAML.clear()
        # what OmegaConf.to_yaml does with the container it builds (omegaconf/omegaconf.py)
        _YAML[key] = yaml.dump(_plain(cfg), default_flow_style=False, allow_unicode=True, sort_keys=False,
                               Dumper=get_omega_conf_dumper())
    return _YAML[key]


def _plain(cfg: Any) -> Any:
    """`OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)`, from the dataclasses
    where _container can read them."""
    try:
        return _container(cfg)
    except _Unplain:  # a value OmegaConf would convert in a way _container does not copy
        return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


class _Unplain(Exception):
    """A config value _container does not write as OmegaConf's structured copy would."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _container(node: Any, hint: Any = None) -> Any:
    """`OmegaConf.to_container(OmegaConf.structured(node), enum_to_str=True)` read straight from
    the dataclasses: the structured copy costs ~0.05 CPU-s for the whole tree (OmegaConf wraps
    and validates every value), and every run writes its config (~13 % of a tiny in-process run).
    What the copy changes is copied here: an enum becomes its name, a tuple a list, an int in a
    float field a float; any value beyond plain data raises _Unplain."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        hints = _hints(type(node))
        return {f.name: _container(getattr(node, f.name), hints.get(f.name)) for f in dataclasses.fields(node)}
    if isinstance(node, enum.Enum):
        return node.name
    if isinstance(node, (list, tuple)):
        args = typing.get_args(hint)
        return [_container(v, args[0] if args else None) for v in node]
    if isinstance(node, dict):
        args = typing.get_args(hint)
        if any(type(k) is not str for k in node):
            raise _Unplain(node)
        return {k: _container(v, args[1] if len(args) == 2 else None) for k, v in node.items()}
    if node is None:
        return node
    kind = type(node)
    if kind not in (bool, int, float, str):
        raise _Unplain(node)
    allowed = _primitives(hint)
    if allowed is None or kind in allowed:  # Any, or a type of the field: kept as it is
        return node
    if kind is int and float in allowed:  # OmegaConf's float node holds 3 as 3.0
        return float(node)
    raise _Unplain(node)  # OmegaConf would convert it (a str field given 5 writes '5')


def _primitives(hint: Any) -> tuple[type, ...] | None:
    """The primitive types a field annotated `hint` holds (float | None -> (float,)); None for Any,
    an enum or a type this does not read."""
    if hint in (bool, int, float, str):
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = tuple(a for a in typing.get_args(hint) if a is not type(None))
        return args if all(a in (bool, int, float, str) for a in args) else None
    return None


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (nested dicts, lists, strings for choices), e.g. for a tracker."""
    return _plain(cfg)


__all__ = [
    "PARALLEL_DEGREES", "TRAIN_LAYOUT_KEYS", "Choice", "Config", "DataConfig", "LauncherConfig", "LoraConfig", "LossConfig", "MoEConfig", "Mode",
    "DistillConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "VideoModelConfig", "config_dir",
    "parallel_layout_keys", "to_config", "to_dict", "to_yaml",
]
