"""What request tracing costs: two clusters of the same checkpoint side by side, one with
tracing off (the default), one tracing every request (``--trace-sample-ratio 1``) to a real
OTLP/gRPC receiver in this process; the same closed-loop workload (disaggregated, greedy, EOS
ignored) in alternating rounds (off, on, off, ...) so that drift of the machine affects both
alike. Reports the router's CPU seconds per request (``/proc/<pid>/stat``), client TTFT and
TPOT p50, and the spans received; ratios on/off; one JSON line.

    .venv/bin/python benchmarks/tracing.py [--requests 240] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench_inputs import REPO, ensure_model, make_prompts  # sibling modules
from frontends import cpu_s

from app.bench.runner import LoadConfig, run_load
from app.bench.stats import RequestRecord, summarize
from app.bench.workload import BenchRequest
from app.local_cluster import ClusterConfig, LocalCluster
from router.phases import RequestPhase
from router.plan import Route
from router.request_trace import RequestTrace

sys.path.insert(0, str(REPO))  # the test suite's OTLP receiver
from tests.services.otlp_receiver import OtlpReceiver

MODES = ("off", "on")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=240, help="requests per mode (240)")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds per mode")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients (4)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny", help="checkpoint size")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--quick", action="store_true", help="CI smoke: 16 requests, 2 rounds")
    args = p.parse_args()
    if args.quick:
        args.requests, args.rounds, args.output_len = 16, 2, 4
    if args.requests % args.rounds:
        p.error("--requests must be a multiple of --rounds")
    return args


def cluster_config(model_dir: Path, name: str, traced: tuple[str, ...]) -> ClusterConfig:
    return ClusterConfig(
        model=str(model_dir),
        redis_namespace=f"tracing-bench-{name}",
        prefill_args=traced,
        decode_args=traced,
        router_args=(*traced, "--local-prefill-tokens", "0"),  # every request disaggregated
    )


def untraced_request_us(n: int = 20000) -> float:
    """What a request's phases cost the router with tracing off (this process has no tracer):
    the clock, the splits, the breakdown and the histograms, per request, in microseconds."""
    start = time.perf_counter()
    for _ in range(n):
        now = time.perf_counter()
        trace = RequestTrace("r", now)
        trace.enter(RequestPhase.ROUTE)
        trace.routed(Route.DISAGGREGATED)
        trace.metadata()
        trace.enter(RequestPhase.PREFILL_RPC)
        trace.prefilled(time.perf_counter(), 1e-4, 2e-4, RequestPhase.DECODE_ADMISSION)
        trace.admitted(1e-4)
        trace.finish()
        trace.breakdown()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    args = parse_args()
    model_dir = ensure_model(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    per_round = args.requests // args.rounds
    records: dict[str, list[RequestRecord]] = {m: [] for m in MODES}
    cpu = dict.fromkeys(MODES, 0.0)
    durations = dict.fromkeys(MODES, 0.0)
    with (
        OtlpReceiver() as receiver,
        LocalCluster(cluster_config(model_dir, "off", ())) as off,
        LocalCluster(
            cluster_config(
                model_dir,
                "on",
                ("--otlp-endpoint", receiver.endpoint, "--trace-sample-ratio", "1"),
            )
        ) as on,
    ):
        clusters = {"off": off, "on": on}
        pids = {}
        for mode, cluster in clusters.items():
            assert cluster.router is not None
            pids[mode] = cluster.router.process.pid
        loads = {
            m: LoadConfig(router=c.address, concurrency=args.concurrency)
            for m, c in clusters.items()
        }
        warm = [BenchRequest(tuple(p), output_len=4) for p in make_prompts(1, 4, 16, vocab)]
        for mode in MODES:
            asyncio.run(run_load(loads[mode], warm))
        for r in range(args.rounds):
            for mode in MODES:
                seed = 1000 + 2 * r + MODES.index(mode)  # fresh prompts: no prefix-cache hits
                prompts = make_prompts(seed, per_round, args.input_len, vocab)
                requests = [BenchRequest(tuple(p), output_len=args.output_len) for p in prompts]
                before = cpu_s(pids[mode])
                got, duration_s = asyncio.run(run_load(loads[mode], requests))
                cpu[mode] += cpu_s(pids[mode]) - before
                durations[mode] += duration_s
                records[mode].extend(got)
        wanted = args.requests + len(warm)
        roots = ("pdserve.request", "prefill_worker.prefill", "decode_worker.admission")
        spans = receiver.wait(
            lambda got: all(sum(s.name == r for s in got) >= wanted for r in roots),
            timeout_s=120,
        )
    rows: dict[str, dict[str, Any]] = {}
    print(f"{'tracing':<8} {'ok':>5} {'TTFT p50':>10} {'TPOT p50':>10} {'router CPU/req':>15}")
    for mode in MODES:
        s = summarize(records[mode], durations[mode])
        rows[mode] = {
            "completed": s.num_completed,
            "failed": s.num_failed,
            "ttft_p50_ms": s.ttft_s.p50 * 1e3,
            "tpot_p50_ms": s.tpot_s.p50 * 1e3,
            "router_cpu_ms_per_request": cpu[mode] / len(records[mode]) * 1e3,
        }
        row = rows[mode]
        print(
            f"{mode:<8} {s.num_completed:>5} {row['ttft_p50_ms']:>8.2f}ms "
            f"{row['tpot_p50_ms']:>8.2f}ms {row['router_cpu_ms_per_request']:>13.3f}ms"
        )
    per_request = {
        service: sum(s.service == service for s in spans) / wanted
        for service in ("pdserve-router", "pdserve-prefill", "pdserve-decode")
    }
    off_row, on_row = rows["off"], rows["on"]
    untraced_us = untraced_request_us()
    report = {
        "benchmark": "tracing",
        "requests_per_mode": args.requests,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rows": rows,
        "spans_per_request": per_request,
        "router_cpu_added_ms_per_request": (
            on_row["router_cpu_ms_per_request"] - off_row["router_cpu_ms_per_request"]
        ),
        "on_over_off_router_cpu": (
            on_row["router_cpu_ms_per_request"] / off_row["router_cpu_ms_per_request"]
        ),
        "on_over_off_ttft_p50": on_row["ttft_p50_ms"] / off_row["ttft_p50_ms"],
        "on_over_off_tpot_p50": on_row["tpot_p50_ms"] / off_row["tpot_p50_ms"],
        "untraced_phases_us_per_request": untraced_us,
    }
    print(
        f"tracing on / off: router CPU/request {report['on_over_off_router_cpu']:.2f}x "
        f"({report['router_cpu_added_ms_per_request']:+.3f} ms), TTFT p50 "
        f"{report['on_over_off_ttft_p50']:.2f}x, TPOT p50 {report['on_over_off_tpot_p50']:.2f}x; "
        f"spans per request: {per_request}; tracing off, a request's phases cost the router "
        f"{untraced_us:.1f} us"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
