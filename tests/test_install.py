"""Installing where users train: the wheel has one top-level import name, `dit_train` (so it
installs beside Hugging Face's `kernels`), and its dependencies resolve on Linux x86_64, Linux
aarch64 (GH200/GB200 nodes) and macOS arm64 (Apple Silicon).

The wheel is built once (~2 s, offline). The install beside Hugging Face's `kernels` and the
per-platform resolution fetch from the package index (~1 min together): they are marked
`install` and run by `make test-install` (`pytest --run-install`; .ci/run runs it before the
suite), skipped by `make test`, and skipped, saying so, where the index cannot be reached. The
resolution patches pip's marker environment, since pip's `--platform` picks wheels
for the target but evaluates `; sys_platform == ...` markers for the machine it runs on (pypa/pip
#11664) and so cannot see a platform marker at work; torch is stood in for by a stub wheel (users
bring their own build; on aarch64 PyPI's is the CUDA one with ~3 GB of nvidia wheels, which pip
would download to resolve), and its wheels are listed per platform instead.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
SOURCES = ("pyproject.toml", "README.md", "dit_train", "kernels", "data_pipelines", "conf")
NO_NETWORK = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                        r"Network is unreachable|ConnectionError|ProxyError", re.I)


def _pip(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # without tests/conftest.py's PYTHONPATH (the checkout, for the suite's fresh Pythons): on it,
    # pip sees the checkout's dit_train.egg-info as dit_train installed in the fresh venv and skips the wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _skip_if_offline(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode and NO_NETWORK.search(proc.stdout + proc.stderr):
        pytest.skip(f"the package index cannot be reached ({what})")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this working tree, built from a copy (a build writes build/ and *.egg-info
    beside its sources) with the installed setuptools, offline."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    proc = _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "dist"), str(src))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (tmp / "dist").glob("dit_train-*.whl")
    return built


def test_the_wheel_has_one_top_level_package(wheel):
    """kernels/ and data_pipelines/ ship inside dit_train (through the links dit_train/kernels and
    dit_train/data_pipelines), every module of them; nothing else is installed at the top level."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"dit_train", wheel.name.split("-py3")[0] + ".dist-info"}
    for folder in ("kernels", "data_pipelines"):
        modules = {p.name for p in (REPO / folder).glob("*.py")}
        assert modules and {n.split("/")[-1] for n in names if n.startswith(f"dit_train/{folder}/")} == modules
    # every file Hydra may compose, at any depth (conf/hydra/job_logging/ was missed once)
    shipped = {n.removeprefix("dit_train/") for n in names if n.startswith("dit_train/conf/")}
    missing = sorted(str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")
                     if str(p.relative_to(REPO)) not in shipped)
    assert not missing, missing
    # decord only where it has wheels (the resolution below checks it against the index too)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    decord = next(Requirement(line.split(": ", 1)[1]) for line in meta.splitlines() if line.startswith("Requires-Dist: decord"))
    where = {f"{s}/{m}": decord.marker.evaluate({**default_environment(), "sys_platform": s, "platform_machine": m})
             for s, m in (("linux", "x86_64"), ("win32", "AMD64"), ("linux", "aarch64"), ("darwin", "arm64"), ("darwin", "x86_64"))}
    assert where == {"linux/x86_64": True, "win32/AMD64": True, "linux/aarch64": False, "darwin/arm64": False,
                     "darwin/x86_64": False}


_CHECK = """
import json, sys, kernels, dit_train.kernels, dit_train.data_pipelines.video_io
print(json.dumps({"hf": kernels.__file__, "hf_loader": hasattr(kernels, "get_kernel"),
                  "ours": dit_train.kernels.__file__, "varlen": hasattr(dit_train.kernels, "VarlenLayout"),
                  "data": dit_train.data_pipelines.video_io.__file__}))
"""


@pytest.mark.install
def test_the_wheel_installs_beside_hugging_faces_kernels(wheel, tmp_path):
    """A fresh venv with the wheel and Hugging Face's `kernels` (both --no-deps; the suite's own
    site-packages lend torch & co. through a .pth): `import kernels` is theirs, `import
    dit_train.kernels` ours, no file belongs to both. The same venv run from the repository root
    imports the checkout (a plain source checkout needs no install; there the repository's own
    top-level kernels/ folder is on the path first, as any folder of the working directory is)."""
    dl = _pip("download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(tmp_path / "hf"), "kernels")
    _skip_if_offline(dl, "Hugging Face's kernels wheel")
    assert dl.returncode == 0, dl.stderr[-2000:]
    (hf,) = (tmp_path / "hf").glob("kernels-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # pip of this venv, installing into the fresh one (which has no pip: venv creation stays ~1 s)
    proc = _pip("--python", python, "install", "--no-deps", "--no-index", "-q", str(wheel), str(hf), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    records = {d.name: {line.split(",")[0] for line in (d / "RECORD").read_text().splitlines()}
               for d in site.glob("*.dist-info")}
    assert len(records) == 2, records.keys()
    ours, theirs = (records[k] for k in sorted(records, key=lambda k: not k.startswith("dit_train")))
    assert not ours & theirs, sorted(ours & theirs)[:5]  # pip would have overwritten these
    ours_top = {p.split("/")[0] for p in ours if not p.startswith("..")}  # ../../../bin/dit-train: the script
    assert ours_top == {"dit_train", next(k for k in records if k.startswith("dit_train"))}, ours_top
    # torch, numpy... from the suite's venv, after the fresh venv's own site-packages
    lent = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "suite.pth").write_text("".join(f"{path}\n" for path in lent))
    run = subprocess.run([python, "-I", "-c", _CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["hf"] == str(site / "kernels" / "__init__.py") and got["hf_loader"]
    assert got["ours"] == str(site / "dit_train" / "kernels" / "__init__.py") and got["varlen"]
    assert got["data"] == str(site / "dit_train" / "data_pipelines" / "video_io.py")
    checkout = subprocess.run([python, "-c", _CHECK], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert checkout.returncode == 0, checkout.stderr[-3000:]
    assert json.loads(checkout.stdout.splitlines()[-1])["ours"] == str(REPO / "dit_train" / "kernels" / "__init__.py")
    # the installed command trains from another directory (it composes conf/ from the wheel), and a
    # tool reads what it wrote
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the wheel's files, not a checkout's
    train = subprocess.run([str(venv / "bin" / "dit-train"), "train.steps=2", "train.sample_every=0", "train.progress=false",
                            "hydra.run.dir=run", f"data.cache_dir={tmp_path / 'cache'}"],
                           cwd=elsewhere, capture_output=True, text=True, timeout=600, env=env)
    assert train.returncode == 0, (train.stdout + train.stderr)[-3000:]
    assert (elsewhere / "run" / "weights.safetensors").is_file()
    export = subprocess.run([python, "-m", "dit_train.tools.export_weights", "run", "--out", "exported.safetensors"],
                            cwd=elsewhere, capture_output=True, text=True, timeout=300, env=env)
    assert export.returncode == 0 and (elsewhere / "exported.safetensors").is_file(), export.stderr[-3000:]


# -- dependencies resolve on each platform -----------------------------------------------------


def _manylinux(arch: str) -> list[str]:
    # pip does not widen a PEP 600 tag to older glibc: list them (manylinux_2_28 = the hosts of
    # GH200/GB200 nodes and current x86_64 clusters; decord's wheel is manylinux2010)
    legacy = ["manylinux2014", "manylinux2010", "manylinux1"] if arch == "x86_64" else ["manylinux2014"]
    return [f"manylinux_2_{v}_{arch}" for v in range(28, 16, -1)] + [f"{tag}_{arch}" for tag in legacy]


# target: (marker environment, wheel platform tags)
TARGETS = {
    "linux_x86_64": ({"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"},
                     _manylinux("x86_64")),
    "linux_aarch64": ({"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64"},
                      _manylinux("aarch64")),
    "macos_arm64": ({"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"},
                    ["macosx_14_0_arm64"]),
}

# pip with the marker environment of another platform (argv: environment as JSON, pip's arguments)
_PIP_FOR_PLATFORM = """
import json, sys
import pip._vendor.packaging.markers as markers
env = {**markers.default_environment(), **json.loads(sys.argv[1])}
markers.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

# published as an sdist only (pure Python: it builds on every platform); hydra-core pins it
SDIST_ONLY = ("antlr4-python3-runtime",)
TORCH_STUB = "2.13.0+stub"


def _stub_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel with metadata only: `name` is then installed as far as the resolver can see."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: dit_train-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.fixture(scope="module")
def links(tmp_path_factory) -> Path:
    """A find-links folder: the torch stub, and wheels of SDIST_ONLY at the versions installed here."""
    from importlib.metadata import version

    folder = tmp_path_factory.mktemp("links")
    _stub_wheel(folder, "torch", TORCH_STUB)
    pins = [f"{name}=={version(name)}" for name in SDIST_ONLY]
    proc = _pip("wheel", "--no-deps", "-q", "-w", str(folder), *pins)
    _skip_if_offline(proc, f"building {', '.join(pins)}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (folder / "constraints.txt").write_text(f"torch=={TORCH_STUB}\n")
    return folder


def _resolve(target: str, wheel: Path, links: Path, work: Path) -> str:
    """'' if the wheel's dependencies resolve for `target` as they should, else what went wrong."""
    env, tags = TARGETS[target]
    platforms = [a for tag in tags for a in ("--platform", tag)]
    report = work / f"{target}.json"
    proc = subprocess.run(
        [sys.executable, "-c", _PIP_FOR_PLATFORM, json.dumps({**env, "platform_release": "", "platform_version": ""}),
         "install", "--disable-pip-version-check", "--dry-run", "-q", "--only-binary=:all:", "--python-version", PY,
         *platforms, "--target", str(work / target), "--find-links", str(links),
         "-c", str(links / "constraints.txt"), "--report", str(report), str(wheel)],
        capture_output=True, text=True, timeout=600)
    _skip_if_offline(proc, f"resolving for {target}")
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        return f"dependencies do not resolve: {' '.join(errors) or proc.stderr.strip()[-1500:]}"
    resolved = json.loads(report.read_text())
    seen = {k: resolved["environment"][k] for k in env}
    if seen != env:
        return f"pip evaluated markers for {seen}, not the target"
    got = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"] for item in resolved["install"]}
    missing = {"dit-train", "av", "diffusers", "peft", "hydra-core", "numpy", "safetensors", "pillow"} - got.keys()
    if missing or got.get("torch") != TORCH_STUB:  # the stub: no torch build (and no CUDA) was needed
        return f"resolved {sorted(got)} (missing {sorted(missing)}, torch {got.get('torch')})"
    if ("decord" in got) != (target == "linux_x86_64"):
        return f"decord {'resolved' if 'decord' in got else 'left out'} (it has wheels for x86_64 Linux and Windows only)"
    # torch itself (the user's build) has a wheel for this Python on the target
    listed = _pip("index", "versions", "torch", "--python-version", PY, *platforms, timeout=300)
    _skip_if_offline(listed, f"listing torch for {target}")
    found = re.search(r"Available versions: (.*)", listed.stdout)
    versions = found.group(1).split(", ") if found else []
    if not any(tuple(int(x) for x in re.findall(r"\d+", v)[:2]) >= (2, 6) for v in versions):
        return f"no torch >= 2.6 wheel for Python {PY}: {listed.stdout.strip() or listed.stderr.strip()[-500:]}"
    return ""


@pytest.mark.install
def test_dependencies_resolve_on_every_platform(wheel, links, tmp_path):
    """pip's dry run of the wheel for each target (in parallel: each mostly waits on downloads)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(TARGETS)) as pool:
        problems = dict(zip(TARGETS, pool.map(lambda t: _resolve(t, wheel, links, tmp_path), TARGETS)))
    assert not any(problems.values()), "\n".join(f"{t}: {why}" for t, why in problems.items() if why)
