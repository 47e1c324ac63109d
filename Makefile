# Two commands for a fresh machine:  make run   (main job, embedded data)   make test   (the suite)
# Both create .venv once. CPU torch comes from the pinned local wheel; on a GPU machine install
# your CUDA torch into .venv first (or set TORCH_SPEC) and it is kept.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: run test setup clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: a bare `torch` requirement with no torch installed would pull a multi-GB CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,slurm]"
	touch $@

run: setup
	$(PY) -m dit_train $(ARGS)

test: setup
	$(PY) -m pytest -q tests $(ARGS)

clean-venv:
	rm -rf $(VENV)
