# Two entry points for users: `make demo` and `make test`. Both build .venv from scratch on a
# fresh machine; installs are pinned by requirements/constraints-cpu.txt (CPU torch wheel).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := requirements/constraints-cpu.txt
DEMO_MODEL := models/demo-llama-tiny

.PHONY: demo test lint typecheck unit bench install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml $(CONSTRAINTS)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(DEMO_MODEL)/config.json: | $(VENV)/.installed
	$(VENV)/bin/pdserve make-model $(DEMO_MODEL) --arch llama --size tiny --seed 0

demo: $(VENV)/.installed $(DEMO_MODEL)/config.json
	$(VENV)/bin/pdserve demo --model $(DEMO_MODEL)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

unit: $(VENV)/.installed-dev
	$(PY) -m pytest -q

test: lint typecheck unit

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/engine_decode.py

clean:
	rm -rf $(VENV) models .mypy_cache .ruff_cache .pytest_cache
