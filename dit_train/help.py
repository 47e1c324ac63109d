"""`python -m dit_train --help`: the config groups and every key with its default and the
one-line description written next to it in the schema (comments on or above each field), so
the help cannot drift from the code."""
from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from dit_train.compose import compose
from dit_train.config import config_dir
from dit_train.config.schema import LauncherConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from dit_train.data_pipelines import SOURCES
from dit_train.models import MODELS

_FIELD = re.compile(r"^\s+(\w+):[^=#]*(?:=[^#]*)?(?:#\s*(.*))?$")


def field_help(cls: type) -> dict[str, str]:
    """{field: description} from the comment after a field or the comment lines just above it."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        above: list[str] = []
        for line in inspect.getsource(klass).splitlines()[1:]:
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("# "))
                continue
            m = _FIELD.match(line)
            if m and not stripped.startswith(('"""', "def ")):
                text = m.group(2) or " ".join(above)
                if text:
                    out[m.group(1)] = text
            above = []
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


def _rows(prefix: str, cls: type, values: Any = None, skip: set[str] = frozenset()) -> list[str]:
    """One line per key: name, value (of `values`, the default run's node, else the schema
    default) and description."""
    helps = field_help(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = getattr(values, f.name) if values is not None else _default(f)
        value = getattr(value, "value", value)
        shown = '""' if value == "" else str(value)
        rows.append(f"  {prefix + f.name:<34} {shown:<14} {helps.get(f.name, '')}".rstrip())
    return rows


def help_text() -> str:
    conf = config_dir()
    groups = [f"  {g.name}={'|'.join(sorted(p.stem for p in g.glob('*.yaml')))}" for g in sorted(conf.iterdir())
              if g.is_dir() and g.name != "experiment"]
    experiments = "|".join(sorted(p.stem for p in (conf / "experiment").glob("*.yaml")))
    lines = ["usage: python -m dit_train [group=option ...] [key=value ...]   (dit-train after pip install)",
             "       python -m dit_train -m key=a,b ...                      (a sweep: one run per combination)",
             "", "Config groups (conf/<group>/<option>.yaml):", *groups, f"  +experiment={experiments}", ""]

    default = compose([])
    lines.append("Keys, with the value of the default run (python -m dit_train without overrides):")
    for name, cls in (("train", TrainConfig), ("optim", OptimConfig), ("loss", LossConfig), ("parallel", ParallelConfig),
                      ("launcher", LauncherConfig)):
        lines += [f"{name}.*", *_rows(f"{name}.", cls, getattr(default, name)), ""]
    for spec in MODELS.values():
        here = default.model if default.model.name == spec.name else None
        lines += [f"model.* of model.name={spec.name} ({'the default run' if here else 'schema defaults'}):",
                  *_rows("model.", spec.config, here, {"name"}), ""]
    for src in SOURCES.values():
        here = default.data if default.data.name == src.name else None
        lines += [f"data.* of data={src.name} ({'the default run' if here else 'schema defaults'}):",
                  *_rows("data.", src.config, here, {"name"}), ""]
    lines += ["The resolved config of a command: python -m dit_train <overrides> --cfg job",
              "Hydra's own options: python -m dit_train --hydra-help. Docs: README.md and docs/."]
    return "\n".join(lines)
