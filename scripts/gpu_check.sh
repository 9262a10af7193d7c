#!/usr/bin/env bash
# GPU check (< 10 min): Triton kernels on CUDA vs the torch path, the engine benchmark in
# bf16 on CUDA, NIXL with VRAM caches, then the vLLM engine on CUDA (disaggregated, exact, and
# against `vllm serve` and vLLM's own P/D; NIXL from VRAM; TP=2 -> TP=2 and unequal TP on two
# GPUs).
# Run from the repository root on an NVIDIA GPU machine.
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
# The quantized cache on CUDA (Triton decode kernel with codes, the torch store); the backend
# comparison test pins the CPU kernel, so it stays on CPU runs.
TRITON_INTERPRET=0 .venv/bin/python -m pytest -q tests/engine/test_kv_quant.py \
  -k "not torch_cpu_and_triton"
.venv/bin/python benchmarks/engine_decode.py --device cuda --dtype bfloat16
# NIXL with the KV caches in VRAM (the tests' engines pick CUDA when it is there): the contract
# suite's nixl cases and the two-process test (a restarted peer, kill -9, SIGSTOP).
.venv/bin/python -m pytest -q tests/contract/test_kvtransfer_contract.py -k nixl \
  tests/nixl/test_nixl_processes.py
# The vLLM engine on CUDA (docs/engines.md), in an environment of its own (vLLM pins packages
# below the main one's): the CUDA wheel of the release the CPU build pins.
if [ ! -x .venv-vllm-cuda/bin/python ]; then
  $PY -m venv .venv-vllm-cuda
  .venv-vllm-cuda/bin/pip install --quiet vllm==0.32.0 nixl-cu12==1.5.1 nixl==1.5.1
  .venv-vllm-cuda/bin/pip install --quiet -e . pytest pytest-timeout openai httpx2 gguf accelerate
fi
VPY=.venv-vllm-cuda/bin/python
# The V1 model runner (pdserve's sampler; Model Runner V2 is refused by name), exactness, and
# NIXL from VRAM: a TP=1 pair over NIXL, each worker's agent over its own CUDA pages.
$VPY -m pytest -q tests/vllm/test_serving_engine_vllm.py tests/vllm/test_vllm_disaggregation.py \
  tests/vllm/test_vllm_pieces.py "tests/vllm/test_vllm_tp_pairs.py::test_tensor_parallel_streams_equal_the_decode_workers_own_run[p1-d1-nixl]"
SERVING="--dtypes bfloat16 --rates 2 --workloads random:256:64 --clients vllm,pdserve"
$VPY benchmarks/serving.py --systems vllm-serve,vllm-colocated,vllm-1p1d,vllm-pd $SERVING
# Tensor parallelism: TP=2 -> TP=2 over NIXL, and unequal TP both ways (CUDA pages cut by
# heads: pdserve's connector asks vLLM for its LBHNC layout).
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  $VPY -m pytest -q tests/vllm/test_vllm_tp_pairs.py -k "p2-d2-nixl or p2-d1-nixl or p1-d2-grpc"
  $VPY benchmarks/serving.py --systems vllm-serve,vllm-1p1d-tp2 $SERVING
fi
