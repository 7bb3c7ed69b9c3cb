# The two commands of the quickstart: `make train` and `make test`. Each sets itself up.
# The first interpreter >= 3.12 that actually runs (a pyenv shim may exist without working).
PY_CANDIDATES := python3.12 python3.13 python3 $(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3)
PYTHON ?= $(firstword $(foreach p,$(PY_CANDIDATES),$(shell $(p) -c 'import sys; assert sys.version_info >= (3, 12); print(sys.executable)' 2>/dev/null)))
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= test
# Tests marked slow run in CI (`.ci/run` passes MARK="slow or not slow"), not by default.
MARK ?= not slow
# Test processes (pytest-xdist): each test module stays in one process, so its module-scoped
# compiles happen once. JOBS=1 runs in this process.
JOBS ?= 2
XDIST := $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)

.PHONY: train test lint setup clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: no python >= 3.12 found; install python3.12 or pass PYTHON=/path/to/python3.12"; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

setup: $(VENV)/.installed-$(EXTRAS)

train: setup
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) scripts/train.py $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "$(MARK)" $(XDIST) $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
