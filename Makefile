# Two commands for a fresh machine:  make run   (main job, embedded data)   make test   (the suite)
# Both create .venv once. CPU torch comes from the pinned local wheel; on a GPU machine install
# your CUDA torch into .venv first (or set TORCH_SPEC) and it is kept.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: run test test-install setup clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: a bare `torch` requirement with no torch installed would pull a multi-GB CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,slurm]"
	touch $@

run: setup
	$(PY) -m dit_train $(ARGS)

# two pytest-xdist workers, whole files each (a file's module fixtures and one-process references
# are built once): the suite was ~1.2 cores busy on average with one pytest process
# (docs/development.md); ARGS='-n 0' runs it in one process
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile tests $(ARGS)

# the wheel installed beside Hugging Face's `kernels`, and its dependencies resolved for Linux
# x86_64 / aarch64 and macOS arm64 (fetches from the package index, ~1 min; CI runs it)
test-install: setup
	$(PY) -m pytest -q tests/test_install.py --run-install $(ARGS)

clean-venv:
	rm -rf $(VENV)
