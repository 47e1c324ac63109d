"""The package's shape, read from its source (nothing is run): imports run down the layers (no
circle, no upward import), an import inside a function only defers a heavy optional dependency,
and the maps in the docs (layers, repository layout, paths) match the tree."""
from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dit_train"

# The layers, ground first: a module imports modules of its own layer or of lower ones, never of
# a higher one. A name is a subpackage or a module of dit_train (the longest name that holds a
# module places it, should a package ever span two layers). The same list is in
# docs/how-it-works.md#layers (test_the_docs_list_the_same_layers).
LAYERS = [
    ("config", "registry", "rng", "batch", "precision", "atomic", "sharded"),
    ("kernels",),
    ("data_pipelines",),
    ("models", "objectives", "optim", "trackers"),
    ("compose",),
    ("loss", "parallel", "tasks", "metrics", "checkpoint", "generate", "perf"),
    ("sampling",),
    ("engine",),
    ("planning", "posttrain", "distill"),
    ("session", "help", "__main__", "tools"),
]

# In-function imports of dit_train modules that must stay (module -> imported module: why).
# Everything else is imported at the top of its module, where the layers above can see it.
LOCAL_IMPORTS: dict[tuple[str, str], str] = {}

# Third-party modules a function may import, to keep start-up and memory free of them until a
# run needs them (seconds measured after `import torch` on 2 busy cores), with why; each such
# import says so in a comment on its line or the line above. Everything else is imported at the
# top of its module.
DEFERRED = {
    "diffusers": "~2 s; Wan models, VAEs, the sampler's scheduler",
    "peft": "~4 s (it imports transformers); LoRA runs only",
    "transformers": "optional (the text extra); caption encoders of latent caches",
    "wandb": "optional (the wandb extra), ~0.4 s; train.loggers=[wandb] only",
    "tensorboard": "~0.3 s; train.loggers=[tensorboard] only (also through torch.utils.tensorboard)",
    "matplotlib": "~0.5 s; the plotting tool only",
    "decord": "optional reader (x86_64 wheels only), ~1 s",
    "av": "loads FFmpeg, ~1 s; the PyAV reader and writing mp4s",
    "torchcodec": "optional reader",
    "xformers": "optional CUDA kernels",
    "flash_attn": "optional CUDA kernels",
    "submitit": "optional (the slurm extra)",
    "torch.nn.attention.flex_attention": "imports torch._dynamo, ~1.8 s at every start; the flex backend only",
    # torch.distributed.tensor imports sympy and torch.fx's symbolic shapes; fsdp and checkpoint
    # import it (dit_train/sharded.py asks "is it a DTensor?" without importing it)
    "torch.distributed.tensor": "~1.5 s at every start; FSDP2, expert parallelism, checkpoints only",
    "torch.distributed.fsdp": "imports torch.distributed.tensor; parallel.dp_mode=fsdp2 on several processes only",
    "torch.distributed.checkpoint": "~1.8 s with torch.distributed.tensor; writing or reading checkpoints only",
    "torchao": "optional (the quant extra), ~1 s; model.base_quant only",
    "webdataset": "optional (the shards extra), ~1.2 s; writing shards only (tools.make_shards, cache_latents --shards)",
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name, e.g. dit_train.engine.worker
    target: str  # the dit_train module it loads (a submodule when the name is one)
    line: int
    in_function: bool


def modules() -> dict[str, Path]:
    """Every module of the installed package (the links dit_train/kernels, dit_train/data_pipelines
    followed: they are imported as dit_train.kernels and dit_train.data_pipelines)."""
    out = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d not in ("conf", "__pycache__"))
        for f in files:
            if f.endswith(".py"):
                path = Path(folder) / f
                parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                out[".".join(parts)] = path
    return out


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> tuple[list[str], ast.AST, set[int]]:
    """A module's lines, syntax tree and the ids of its imports inside functions, parsed once
    for every test of this file (~300 modules)."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    return text.splitlines(), tree, _functions(tree)


def _functions(tree: ast.AST) -> set[int]:
    """ids of the import statements inside a function or lambda."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inside


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods: dict[str, Path]) -> list[Import]:
    """Every import of a dit_train module, at the top of a module or inside a function."""
    out = []
    for name, path in mods.items():
        _, tree, inside = _parsed(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(node, name, path.name == "__init__.py")
                # `from pkg import sub` loads the submodule; `from mod import name` the module
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            else:
                continue
            for t in dict.fromkeys(targets):
                if t == "dit_train" or t.startswith("dit_train."):
                    out.append(Import(name, t, node.lineno, id(node) in inside))
    return out


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest name that holds `module` (dit_train itself: the ground)."""
    rel = module.removeprefix("dit_train").lstrip(".")
    best, index = -1, 0
    for i, names in enumerate(LAYERS):
        for n in names:
            if (rel == n or rel.startswith(n + ".")) and len(n) > best:
                best, index = len(n), i
    assert best >= 0 or not rel, f"{module} is in no layer: add it to LAYERS (and docs/how-it-works.md#layers)"
    return index


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_no_import_circle():
    edges: dict[str, set[str]] = {}
    for imp in imports(modules()):
        edges.setdefault(imp.importer, set()).add(imp.target)
    found = circles(edges)
    assert not found, "import circles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_import_runs_up_the_layers():
    up = [f"{i.importer}:{i.line} imports {i.target} (layer {layer_of(i.importer)} -> {layer_of(i.target)})"
          for i in imports(modules()) if layer_of(i.target) > layer_of(i.importer)]
    assert not up, "imports that run up the layers (LAYERS, ground first):\n" + "\n".join(up)


def test_no_dit_train_import_inside_a_function():
    hidden = [f"{i.importer}:{i.line} imports {i.target}" for i in imports(modules())
              if i.in_function and (i.importer, i.target) not in LOCAL_IMPORTS]
    assert not hidden, ("imports of dit_train modules inside functions (move them to the top of the module, or "
                        "fix the layering that made them hide there):\n" + "\n".join(hidden))


def test_imports_inside_functions_defer_heavy_dependencies_and_say_so():
    """Only DEFERRED modules are imported inside functions, each with a comment (its line or the one above)."""
    wrong = []
    for name, path in modules().items():
        lines, tree, inside = _parsed(path)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) not in inside:
                continue
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                top = _deferred(m) or m.split(".")[0]
                if not m or top == "dit_train" or node.__dict__.get("level"):
                    continue
                if top not in DEFERRED:
                    wrong.append(f"{name}:{node.lineno} imports {m} inside a function (not a heavy optional "
                                 f"dependency: import it at the top)")
                elif "#" not in lines[node.lineno - 1] and "#" not in lines[node.lineno - 2]:
                    wrong.append(f"{name}:{node.lineno} defers {m} without a comment saying why")
    assert not wrong, "\n".join(wrong)


def test_deferred_dependencies_are_never_imported_at_a_modules_top():
    """A DEFERRED module imported at the top of any module of the package loads at every start of
    `python -m dit_train` and the tools (the package's modules import each other at their tops).
    What third-party modules import in turn is checked on a refused run (tests/test_cli.py)."""
    wrong = []
    for name, path in modules().items():
        _, tree, inside = _parsed(path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in inside:
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                wrong += [f"{name}:{node.lineno} imports {m} at its top (DEFERRED: {_deferred(m)})"
                          for m in mods if _deferred(m)]
    assert not wrong, "\n".join(wrong)


def _deferred(module: str) -> str:
    """The DEFERRED entry that covers `module` ("" if none)."""
    top = "tensorboard" if module.startswith("torch.utils.tensorboard") else module
    return next((d for d in DEFERRED if top == d or top.startswith(d + ".")), "")


def test_the_docs_list_the_same_layers():
    """docs/how-it-works.md#layers: one numbered line per layer, ground first, naming its parts."""
    text = (REPO / "docs" / "how-it-works.md").read_text()
    assert "\n## Layers\n" in text, "docs/how-it-works.md has no '## Layers' section"
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    documented = []
    for line in section.splitlines():
        if re.match(r"\d+\. ", line):
            names = re.findall(r"`([^`]+)`", line)
            documented.append(tuple(n.removesuffix("/").removesuffix(".py").replace("/", ".") for n in names))
    assert documented == LAYERS


def _layout_rows() -> list[tuple[str, str]]:
    text = (REPO / "docs" / "how-it-works.md").read_text()
    table = text.split("\n## Repository layout\n", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", table, re.M)]


def _top_folders() -> list[str]:
    """The repository's top-level folders that git tracks (not a venv, build outputs or runs)."""
    import subprocess

    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): the package folders are still checked
        return []
    return sorted({f.split("/")[0] + "/" for f in out.stdout.split() if "/" in f and not f.startswith(".")})


def test_the_layout_table_matches_the_tree():
    """Every path of docs/how-it-works.md's layout table exists, and so does every module named in
    a folder's row; every folder of the package, and every top-level folder, has a row."""
    rows = _layout_rows()
    paths = [p for p, _ in rows]
    wrong = [f"the table names {p}, which does not exist" for p in paths if not (REPO / p).exists()]
    for path, what in rows:
        if path.endswith("/") and (REPO / path).is_dir():
            wrong += [f"the row of {path} names {m}, which is not there" for m in re.findall(r"`([\w/]+\.py)`", what)
                      if not (REPO / path / m).exists()]
    # dit_train/kernels/ and dit_train/data_pipelines/ are the links to the top-level folders' rows
    package = [f"{p.parent.name}/" if p.parent.is_symlink() else f"dit_train/{p.parent.name}/"
               for p in sorted(PACKAGE.glob("*/__init__.py"))]
    wrong += [f"no row for {f}" for f in package if f not in paths]
    wrong += [f"no row for {f}" for f in _top_folders() if f != "docs/" and not any(p.startswith(f) for p in paths)]
    wrong += [f"no row for dit_train/{p.name}" for p in sorted(PACKAGE.glob("*.py"))
              if p.name != "__init__.py" and f"dit_train/{p.name}" not in paths]
    assert not wrong, "docs/how-it-works.md's layout table:\n" + "\n".join(wrong)


_PATH = re.compile(r"(?<![\w./-])((?:dit_train|data_pipelines|kernels|conf|tools|tests|docs|benchmarks)/[\w./-]*\w/?)")


def test_paths_in_docs_and_conf_comments_exist():
    """Repository paths named in the README, docs/ and the comments of conf/ (and relative links in
    the docs) point at something that exists; `<name>` placeholders and globs are skipped."""
    broken = []
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for doc in texts:
        text = doc.read_text()
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            target = m.group(1)
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)}: link {target}")
        for m in _PATH.finditer(text):
            path = m.group(1)
            end = text[m.end():m.end() + 1]
            if end in ("<", "*", "{") or "<" in path or not (REPO / path).exists():
                if end not in ("<", "*", "{") and "<" not in path:
                    broken.append(f"{doc.relative_to(REPO)}: {path}")
    for yaml in sorted((REPO / "conf").rglob("*.yaml")):
        for line in yaml.read_text().splitlines():
            comment = line.split("#", 1)[1] if "#" in line else ""
            for m in _PATH.finditer(comment):
                if not (REPO / m.group(1)).exists():
                    broken.append(f"{yaml.relative_to(REPO)}: {m.group(1)}")
    assert not broken, "paths that do not exist:\n" + "\n".join(broken)


def test_no_module_branches_on_a_data_source_name():
    """What differs between data sources is asked through DataSource's hooks (decoder,
    prompt_space, latent, score, ...): no module compares a name with a source's name (conf/data/),
    except the source's own module."""
    sources = {p.stem for p in (REPO / "conf" / "data").glob("*.yaml")}  # data=<name>: the registered sources
    found = []
    for name, path in modules().items():
        if name.endswith("_source"):
            continue
        for node in ast.walk(_parsed(path)[1]):
            if isinstance(node, ast.Compare) and any(isinstance(a, ast.Attribute) and a.attr == "name" for a in ast.walk(node)):
                named = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)} & sources
                if named:
                    found.append(f"{name}:{node.lineno} branches on data source {', '.join(sorted(named))}")
    assert not found, "\n".join(found)
