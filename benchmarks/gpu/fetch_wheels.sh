#!/usr/bin/env bash
# Download, here, the pure-Python packages dit_train needs that a bare GPU machine lacks (its image
# has torch + CUDA, einops, safetensors, peft, transformers, tensorboard, ...; not diffusers, Hydra,
# OmegaConf, ANTLR, PyAV: the embedded world's mp4s, quality_sweep.sh), as Python 3.12 wheels into .whl/ (git-ignored), for check.sh to install there.
#   bash benchmarks/gpu/fetch_wheels.sh [python version, default 3.12]
# Versions are the ones installed in .venv (make setup), so the GPU runs what the suite tested.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
pyver=${1:-3.12}
mkdir -p .whl
rm -f .whl/*.whl
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    "diffusers==$(ver diffusers)" "hydra-core==$(ver hydra-core)" "omegaconf==$(ver omegaconf)" "av==$(ver av)"
# antlr4-python3-runtime 4.9.x (Hydra's pin) is published as a source archive only: build its wheel here
"$PY" -m pip wheel --quiet --no-deps -w .whl "antlr4-python3-runtime==$(ver antlr4-python3-runtime)"
ls -la .whl
