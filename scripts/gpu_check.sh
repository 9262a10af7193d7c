#!/usr/bin/env bash
# GPU check (< 5 min): Triton kernels on CUDA vs the torch path, then the engine benchmark in
# bf16 on CUDA. Run from the repository root on a machine with an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ ! -x .venv/bin/python ]; then
  $PY -m venv .venv
  .venv/bin/pip install --quiet -e '.[dev]'
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# TRITON_INTERPRET=0: the kernel tests pick CUDA when the interpreter is off.
TRITON_INTERPRET=0 .venv/bin/python -m pytest -q tests/engine/test_triton_kernels.py
TRITON_INTERPRET=0 .venv/bin/python -m pytest -q tests/engine/test_kv_cache_paths.py \
  tests/engine/test_hf_parity.py -k "llama and not sharded"
.venv/bin/python benchmarks/engine_decode.py --device cuda --dtype bfloat16
