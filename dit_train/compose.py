"""A typed config from a command line's overrides or a run's config.yaml: where the config
schema (config/) meets the registries of models and data sources, whose nodes are registered
with Hydra's ConfigStore here, so that config/ imports neither.

`compose` (tools, tests, the session API) gives what `python -m dit_train <overrides>` would
run; `load_config` reads the config a run or checkpoint folder was trained with.
"""
from __future__ import annotations

import copy
import io
import logging
import os
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dit_train.config import Config, config_dir, to_config
from dit_train.config.errors import ConfigError
from dit_train.data_pipelines import SOURCES
from dit_train.models import MODELS

log = logging.getLogger(__name__)


_REGISTERED: list[Any] = [None]  # what register_configs last stored, in this process's ConfigStore


def register_configs() -> None:
    """Register the schema: `conf/config.yaml` lists `base_config` first, and every model and
    data group file names its node type (`<name>_schema`) first, so each file is merged into a
    typed node and an unknown key or a wrong type is an error.

    Storing a node converts its dataclass into an OmegaConf config, ~40 % of a compose: it is
    done again only when the registries (or the store) changed since the last call."""
    cs = ConfigStore.instance()
    nodes = [(None, "base_config", Config), *(("model", f"{s.name}_schema", s.config) for s in MODELS.values()),
             *(("data", f"{s.name}_schema", s.config) for s in SOURCES.values())]
    if _REGISTERED[0] == (id(cs), nodes):
        return
    for group, name, node in nodes:
        cs.store(group=group, name=name, node=node)
    _REGISTERED[0] = (id(cs), nodes)
    _TREES.clear()  # composed and read with the nodes stored before
    _LOADED.clear()


# Hydra's tree per (conf/ files' stamps, config-group overrides), in this process: composing
# (~0.25 CPU-s: the defaults tree, loading and merging every file) depends on the group choices
# only; the key=value overrides are applied to the merged tree afterwards, by Hydra's own
# function, as Hydra applies them. Tests, the session API and the tools compose hundreds of
# configs per process that differ in values only (docs/suite-costs.md).
_TREES: dict[tuple[Any, ...], DictConfig] = {}


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The typed Config of `python -m dit_train <overrides>` (same files, same checks), for
    tools, tests and `TrainingSession.from_overrides`."""
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        split = _split(list(overrides))
        if split is None:  # hydra.* keys, sweeps: Hydra composes (and refuses) them whole
            d = hydra_compose("config", overrides=list(overrides))
        else:
            groups, values = split
            key = (_conf_stamps(), groups)
            if key not in _TREES:
                _TREES[key] = hydra_compose("config", overrides=list(groups))
            d = copy.deepcopy(_TREES[key])
            ConfigLoaderImpl._apply_overrides_to_config(values, d)
    return to_config(d)


def _split(overrides: list[str]) -> tuple[tuple[str, ...], list[Override]] | None:
    """The config-group overrides (which pick files: `model=wan`, `+experiment=x`) and the
    key=value ones, split as Hydra's defaults list splits them (`Overrides` in
    hydra/_internal/defaults_list.py); None for what only a whole compose handles (hydra.*, sweeps).
    Called inside `initialize_config_dir`."""
    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    if any(o.is_hydra_override() or o.key_or_group == "hydra" or o.is_sweep_override() for o in parsed):
        return None
    repo = GlobalHydra.instance().hydra.config_loader.repository
    groups, values = [], []
    for o in parsed:
        is_group = repo.group_exists(o.key_or_group) and not isinstance(o.value(), dict)
        (groups.append(o.input_line) if is_group else values.append(o))
    return tuple(groups), values


def _conf_stamps() -> tuple[tuple[str, int, int], ...]:
    """Each conf/ file's path, mtime and size: an edited file is read again (~0.3 ms for ~70 files)."""
    out = []
    for folder, _, files in os.walk(config_dir(), followlinks=True):
        for name in files:
            st = os.stat(os.path.join(folder, name))
            out.append((os.path.join(folder, name), st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


def typed_node(kind: str, node: Any) -> Any:
    """The schema object of a model / data node given as plain YAML (its `name` picks it)."""
    registry = MODELS if kind == "model" else SOURCES
    name = node.get("name") if isinstance(node, (dict, DictConfig)) else None
    if name not in registry:
        raise ValueError(f"{kind}.name={name!r} is not one of {sorted(registry)}")
    return OmegaConf.merge(OmegaConf.structured(registry[name].config), node)


# model keys that widen what a run trusts (pickle loading runs code): a stored config never switches
# them on, only the command line of the current invocation does (applied after load_config)
TRUST_WIDENING = ("allow_pickle_weights",)


# config.yaml text -> (its Config, the TRUST_WIDENING keys it set), in this process: the tools and the
# session API read one run's config again and again (sampling, export, resumes), ~0.15 CPU-s a read
_LOADED: dict[str, tuple[Config, tuple[str, ...]]] = {}


def load_config(path: str | Path) -> Config:
    """The typed Config stored as config.yaml in a run or checkpoint dir (or the file itself).

    A stored config is data from whoever wrote the folder: it is read without resolving anything
    (a run writes its config resolved, so an interpolation such as `${oc.env:SECRET}` or a custom
    resolver is refused, never evaluated), keys that widen trust (TRUST_WIDENING) are reset to
    off, and a file that is not a config of this schema is one ConfigError naming it."""
    p = Path(path)
    p = p / "config.yaml" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: is {path} a dit_train run or checkpoint dir?")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p} is not a readable config ({_first_line(err)}); restore it from the run's "
                          f"checkpoints/step_*/config.yaml or rerun") from None
    register_configs()  # before the lookup: new registries clear _LOADED
    if text not in _LOADED:
        _LOADED[text] = _parse_config(p, text)
    cfg, widened = _LOADED[text]
    for key in widened:
        log.warning("%s sets model.%s=true: ignored (a stored config cannot widen trust); give it on "
                    "this command line if you trust the folder", p, key)
    return copy.deepcopy(cfg)


def _parse_config(p: Path, text: str) -> tuple[Config, tuple[str, ...]]:
    """`load_config`'s reading of the text of `p`: the Config and the trust-widening keys it reset."""
    try:
        raw = OmegaConf.load(io.StringIO(text))
    except Exception as err:  # YAML syntax, unknown tags (OmegaConf's loader is a safe loader)
        raise ConfigError(f"{p} is not a readable config ({_first_line(err)}); restore it from the run's "
                          f"checkpoints/step_*/config.yaml or rerun") from None
    if not isinstance(raw, DictConfig) or "model" not in raw or "data" not in raw:
        raise ConfigError(f"{p} is not a dit_train config (no model and data sections)")
    found = interpolations(OmegaConf.to_container(raw, resolve=False))
    if found:
        raise ConfigError(f"{p} holds interpolations ({', '.join(found[:3])}): a stored config is data and is "
                          f"never resolved (a run writes its config resolved); remove them")
    try:
        root = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in raw.items() if k not in ("model", "data")})
        root.model = typed_node("model", raw.model)
        root.data = typed_node("data", raw.data)
        widened = tuple(key for key in TRUST_WIDENING if root.model.get(key))
        for key in widened:
            root.model[key] = False
        return to_config(root), widened
    except (OmegaConfBaseException, ValueError) as err:
        raise ConfigError(f"{p} does not fit the config schema: {_first_line(err)}") from None


def interpolations(node: Any, where: str = "") -> list[str]:
    """Dotted keys whose string value holds an OmegaConf interpolation (`${...}`)."""
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in interpolations(v, f"{where}.{key}" if where else str(key))]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in interpolations(v, f"{where}[{i}]")]
    return [where] if isinstance(node, str) and "${" in node else []


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
