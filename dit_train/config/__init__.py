"""The typed config tree and how to get one: from the command line (Hydra), from a list of
overrides (`compose`, for tools, tests and the session API) or from a run's `config.yaml`
(`load_config`)."""
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
    VideoModelConfig,
    parallel_layout_keys,
)


def config_dir() -> Path:
    """The conf/ tree: shipped inside the package (`dit_train/conf`, a link to the top-level
    `conf/` in the source tree, copied into wheels), so any install finds it from any directory."""
    return Path(__file__).resolve().parents[1] / "conf"


def register_configs() -> None:
    """Register the schema: `conf/config.yaml` lists `base_config` first, and every model and
    data group file names its node type (`<name>_schema`) first, so each file is merged into a
    typed node and an unknown key or a wrong type is an error."""
    from hydra.core.config_store import ConfigStore

    from dit_train.data_pipelines import SOURCES
    from dit_train.models import MODELS

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for spec in MODELS.values():
        cs.store(group="model", name=f"{spec.name}_schema", node=spec.config)
    for src in SOURCES.values():
        cs.store(group="data", name=f"{src.name}_schema", node=src.config)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The typed Config of `python -m dit_train <overrides>` (same files, same checks), for
    tools, tests and `TrainingSession.from_overrides`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        d = hydra_compose("config", overrides=list(overrides))
    return to_config(d)


def to_config(d: DictConfig) -> Config:
    return OmegaConf.to_object(d)


def typed_node(kind: str, node: Any) -> Any:
    """The schema object of a model / data node given as plain YAML (its `name` picks it)."""
    from dit_train.data_pipelines import SOURCES
    from dit_train.models import MODELS

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


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (nested dicts, lists, strings for choices), e.g. for a tracker."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


__all__ = [
    "PARALLEL_DEGREES", "TRAIN_LAYOUT_KEYS", "Choice", "Config", "DataConfig", "LauncherConfig", "LoraConfig", "LossConfig", "MoEConfig", "Mode",
    "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "VideoModelConfig", "compose", "config_dir",
    "load_config", "parallel_layout_keys", "register_configs", "to_config", "to_dict", "to_yaml",
]
