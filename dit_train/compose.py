"""A typed config from a command line's overrides or a run's config.yaml: where the config
schema (config/) meets the registries of models and data sources, whose nodes are registered
with Hydra's ConfigStore here, so that config/ imports neither.

`compose` (tools, tests, the session API) gives what `python -m dit_train <overrides>` would
run; `load_config` reads the config a run or checkpoint folder was trained with.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from dit_train.config import Config, config_dir, to_config
from dit_train.data_pipelines import SOURCES
from dit_train.models import MODELS


def register_configs() -> None:
    """Register the schema: `conf/config.yaml` lists `base_config` first, and every model and
    data group file names its node type (`<name>_schema`) first, so each file is merged into a
    typed node and an unknown key or a wrong type is an error."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for spec in MODELS.values():
        cs.store(group="model", name=f"{spec.name}_schema", node=spec.config)
    for src in SOURCES.values():
        cs.store(group="data", name=f"{src.name}_schema", node=src.config)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The typed Config of `python -m dit_train <overrides>` (same files, same checks), for
    tools, tests and `TrainingSession.from_overrides`."""
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        d = hydra_compose("config", overrides=list(overrides))
    return to_config(d)


def typed_node(kind: str, node: Any) -> Any:
    """The schema object of a model / data node given as plain YAML (its `name` picks it)."""
    registry = MODELS if kind == "model" else SOURCES
    name = node.get("name") if isinstance(node, (dict, DictConfig)) else None
    if name not in registry:
        raise ValueError(f"{kind}.name={name!r} is not one of {sorted(registry)}")
    return OmegaConf.merge(OmegaConf.structured(registry[name].config), node)


def load_config(path: str | Path) -> Config:
    """The typed Config stored as config.yaml in a run or checkpoint dir (or the file itself)."""
    p = Path(path)
    p = p / "config.yaml" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: is {path} a dit_train run or checkpoint dir?")
    raw = OmegaConf.load(p)
    register_configs()
    root = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in raw.items() if k not in ("model", "data")})
    root.model = typed_node("model", raw.model)
    root.data = typed_node("data", raw.data)
    return to_config(root)
