"""gRPC vs the OpenAI HTTP API (SSE) on one router, in one run: the same closed-loop workload
(token-id prompts, greedy, EOS ignored) through ``pdserve.v1.Router/Generate`` and through
``POST /v1/completions``, in alternating rounds (gRPC, HTTP, gRPC, ...) so that drift of the
machine affects both alike. Client-side TTFT/TPOT p50/p99 for each, and the router process's
CPU seconds per request (``/proc/<pid>/stat``, user + system). Goal: HTTP adds <= 1 ms p50
TTFT over gRPC. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

from bench_inputs import ensure_model, make_prompts  # sibling module

from app.bench.runner import LoadConfig, run_load
from app.bench.stats import RequestRecord, summarize
from app.bench.workload import BenchRequest
from app.local_cluster import ClusterConfig, LocalCluster

FRONTENDS = ("grpc", "http")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=320, help="requests per frontend (320)")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds per frontend")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients (4)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny", help="checkpoint size")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--quick", action="store_true", help="CI smoke: 24 requests, 2 rounds")
    args = p.parse_args()
    if args.quick:
        args.requests, args.rounds, args.output_len = 24, 2, 8
    if args.requests % args.rounds:
        p.error("--requests must be a multiple of --rounds")
    return args


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = parse_args()
    model_dir = ensure_model(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    per_round = args.requests // args.rounds
    config = ClusterConfig(
        model=str(model_dir),
        router_http_port=0,
        # Both frontends reach the same workers the same way: disaggregated, every request.
        router_args=("--local-prefill-tokens", "0"),
    )
    records: dict[str, list[RequestRecord]] = {f: [] for f in FRONTENDS}
    cpu = dict.fromkeys(FRONTENDS, 0.0)
    durations = dict.fromkeys(FRONTENDS, 0.0)
    with LocalCluster(config) as cluster:
        assert cluster.router is not None
        pid = cluster.router.process.pid
        loads = {
            "grpc": LoadConfig(router=cluster.address, concurrency=args.concurrency),
            "http": LoadConfig(http=cluster.http_url, concurrency=args.concurrency),
        }
        # Warm-up (kernels, connections, caches) on both, not measured.
        warm = [BenchRequest(tuple(p), output_len=4) for p in make_prompts(1, 4, 16, vocab)]
        for frontend in FRONTENDS:
            asyncio.run(run_load(loads[frontend], warm))
        for r in range(args.rounds):
            for frontend in FRONTENDS:
                # Fresh prompts every round and frontend: no prefix-cache hits for either.
                seed = 1000 + 2 * r + FRONTENDS.index(frontend)
                prompts = make_prompts(seed, per_round, args.input_len, vocab)
                requests = [BenchRequest(tuple(p), output_len=args.output_len) for p in prompts]
                before = cpu_s(pid)
                got, duration_s = asyncio.run(run_load(loads[frontend], requests))
                cpu[frontend] += cpu_s(pid) - before
                durations[frontend] += duration_s
                records[frontend].extend(got)
    rows: dict[str, dict[str, Any]] = {}
    print(
        f"{'frontend':<9} {'ok':>5} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT p50':>10} "
        f"{'TPOT p99':>10} {'router CPU/req':>15}"
    )
    for frontend in FRONTENDS:
        s = summarize(records[frontend], durations[frontend])
        rows[frontend] = {
            "completed": s.num_completed,
            "failed": s.num_failed,
            "ttft_p50_ms": s.ttft_s.p50 * 1e3,
            "ttft_p99_ms": s.ttft_s.p99 * 1e3,
            "tpot_p50_ms": s.tpot_s.p50 * 1e3,
            "tpot_p99_ms": s.tpot_s.p99 * 1e3,
            "router_cpu_ms_per_request": cpu[frontend] / len(records[frontend]) * 1e3,
        }
        row = rows[frontend]
        print(
            f"{frontend:<9} {s.num_completed:>5} {row['ttft_p50_ms']:>8.2f}ms "
            f"{row['ttft_p99_ms']:>8.2f}ms {row['tpot_p50_ms']:>8.2f}ms "
            f"{row['tpot_p99_ms']:>8.2f}ms {row['router_cpu_ms_per_request']:>13.2f}ms"
        )
    grpc, http = rows["grpc"], rows["http"]
    added_ms = http["ttft_p50_ms"] - grpc["ttft_p50_ms"]
    report = {
        "benchmark": "frontends",
        "requests_per_frontend": args.requests,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rows": rows,
        "http_added_ttft_p50_ms": added_ms,
        "http_over_grpc_ttft_p50": http["ttft_p50_ms"] / grpc["ttft_p50_ms"],
        "http_over_grpc_tpot_p50": http["tpot_p50_ms"] / grpc["tpot_p50_ms"],
        "http_over_grpc_router_cpu": (
            http["router_cpu_ms_per_request"] / grpc["router_cpu_ms_per_request"]
        ),
        "goal_met": added_ms <= 1.0,
    }
    print(
        f"HTTP - gRPC TTFT p50: {added_ms:+.2f} ms (goal <= 1 ms: "
        f"{'met' if report['goal_met'] else 'missed'}); HTTP/gRPC: TTFT p50 "
        f"{report['http_over_grpc_ttft_p50']:.2f}x, TPOT p50 "
        f"{report['http_over_grpc_tpot_p50']:.2f}x, router CPU/request "
        f"{report['http_over_grpc_router_cpu']:.2f}x"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
