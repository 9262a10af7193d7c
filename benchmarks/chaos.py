"""Chaos: an open-loop load on a local cluster (2 prefill + 2 decode, embedded Redis, the
supervisor restarting killed workers, every setting at its default: the stall timeout too)
while a scenario injects faults one at a time (``chaos_scenarios.py``): ``mixed`` (kill -9 of
a decode worker, SIGSTOP of one past the stall timeout, kill -9 of redis-server),
``stuck-step`` (a decode worker whose engine step blocks for good), ``redis-outage-restart``
(Redis down, a decode worker killed and restarted during the outage, Redis back),
``frozen-router`` (the router SIGSTOPped past the workers' keepalive bound), ``hostile-http``
(slowloris heads, trickled bodies and 1 MB heads on the HTTP port during the load),
``hostile-requests`` (requests written to break a worker or a client, and silent sockets,
mixed into the load: each must get its named refusal or a strict-JSON answer, no worker may be
lost, /health's p99 is reported).

The same seeded workload also runs without faults, in the same invocation: the baseline. Every
completed stream is compared token for token with one engine (``native_engine.LLM``); a
difference at a logit near-tie (<= 1e-4) is counted apart, anything else is a failure. Reported per
scenario: requests, completed identical / near-tie, failed, hung (no end within --hang-s),
migrations (router counter), time from each fault to the router's reaction, leaked blocks on
the workers afterwards, the router's peak RSS, client-side TTFT/TPOT p50/p99. Goal: 0 failed,
0 hung, 0 leaked. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chaos_hostile  # sibling modules
import chaos_scenarios
import psutil
from bench_inputs import ensure_model  # sibling module
from chaos_scenarios import Fault, Schedule

from app.bench.stats import RequestRecord, percentile, summarize
from app.client import router_channel
from app.embedded_redis import EmbeddedRedis
from app.local_cluster import ClusterConfig, LocalCluster
from app.settings.flags import field_default
from engine import SamplingParams
from native_engine import LLM
from native_engine.diagnostics import NEAR_TIE, first_difference, sampler_choice
from pdserve.common.convert import sampling_to_proto
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from router.config import RouterConfig

SCENARIOS = {**chaos_scenarios.SCENARIOS, **chaos_hostile.SCENARIOS}
# The router's default stall timeout: faults are detected at the bound users get.
STALL_S = float(field_default(RouterConfig, "stall_timeout_s"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=120, help="requests per run (120)")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (4)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    p.add_argument("--hang-s", type=float, default=120.0, help="a stream this late is hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny", help="checkpoint size")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--smoke", action="store_true", help="24 requests, the mixed scenario")
    args = p.parse_args()
    if args.smoke:
        args.requests, args.scenarios, args.max_tokens = 24, "mixed", 64
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {list(SCENARIOS)}")
    return args


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(args.seed)
    lengths = [rng.randrange(8, 120) for _ in range(args.requests)]
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(
            max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True
        )
        for i in range(args.requests)
    ]
    return prompts, params


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    error: str = ""
    hung: bool = False
    num_migrations: int = 0


async def drive(
    address: str, prompts: list[list[int]], params: list[SamplingParams], args: argparse.Namespace
) -> tuple[list[Outcome], list[RequestRecord], float]:
    """Open-loop arrivals (seeded exponential gaps); every chunk timestamped at the client."""
    clock = time.perf_counter
    outcomes = [Outcome() for _ in prompts]
    records = [RequestRecord(i, len(p), 0.0) for i, p in enumerate(prompts)]
    rng = random.Random(args.seed + 1)
    async with router_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = clock()

        async def one(i: int) -> None:
            record, outcome = records[i], outcomes[i]
            record.send_s = clock() - start
            request = router_pb2.GenerateRequest(
                prompt_token_ids=prompts[i], sampling=sampling_to_proto(params[i])
            )
            try:
                async with asyncio.timeout(args.hang_s):
                    async for response in stub.Generate(request):
                        if response.HasField("final"):
                            outcome.num_migrations = response.final.num_migrations
                        elif response.chunk.token_ids:
                            record.chunk_times_s.append(clock() - start)
                            record.num_output_tokens += len(response.chunk.token_ids)
                            outcome.token_ids.extend(response.chunk.token_ids)
            except TimeoutError:
                outcome.hung = True
                record.error = "hung"
            except Exception as exc:  # a failed request, reported by its error
                outcome.error = record.error = f"{type(exc).__name__}: {exc}"[:300]

        tasks, arrival_s = [], 0.0
        for i in range(len(prompts)):
            arrival_s += rng.expovariate(args.rate)
            await asyncio.sleep(max(0.0, arrival_s - (clock() - start)))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        return outcomes, records, clock() - start


async def leaked_blocks(cluster: LocalCluster, settle_s: float = 30.0) -> int:
    """Blocks still referenced on the live workers once the load is over (waited for)."""
    deadline = time.monotonic() + settle_s
    while True:
        held = 0
        for c in [*cluster.prefill, *cluster.decode]:
            if c.process.poll() is not None or not c.address:
                continue
            async with router_channel(c.address) as channel:
                stub: Any = (
                    prefill_pb2_grpc.PrefillWorkerStub(channel)
                    if c.role is Role.PREFILL
                    else decode_pb2_grpc.DecodeWorkerStub(channel)
                )
                s = await stub.GetStats(common_pb2.GetStatsRequest(), timeout=10)
            held += s.num_blocks - s.num_free_blocks
        if held == 0 or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.2)


def router_metrics(cluster: LocalCluster) -> list[str]:
    assert cluster.router is not None
    url = f"http://{cluster.router.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode().splitlines()


def migrations(lines: list[str]) -> int:
    return int(
        sum(float(x.split()[-1]) for x in lines if x.startswith("pdserve_migrations_total{"))
    )


def migration_extra_p99_s(outcomes: list[Outcome], records: list[RequestRecord]) -> float:
    """Over the streams that migrated: p99 of the longest gap between two chunks beyond that
    stream's median gap (what the handover cost its client), measured at the client."""
    extra = []
    for outcome, record in zip(outcomes, records, strict=True):
        times = record.chunk_times_s
        if outcome.num_migrations and len(times) > 2:
            gaps = sorted(b - a for a, b in itertools.pairwise(times))
            extra.append(gaps[-1] - gaps[len(gaps) // 2])
    return percentile(extra, 99) if extra else 0.0


def run(model_dir: Path, llm: LLM, args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    """One run of the workload: under ``scenario``'s faults, or none (``""``: the baseline)."""
    prompts, params = workload(args)
    references = llm.generate(prompts, params)
    with EmbeddedRedis() as redis:
        config = ClusterConfig(
            model=str(model_dir),
            num_prefill=2,
            num_decode=2,
            redis_url=redis.url,
            router_http_port=0,  # the hostile-http scenario's target (idle otherwise)
            log_level="WARNING",
            restart_delay_s=0.5,
            router_args=("--local-prefill-tokens", "0"),
        )
        with LocalCluster(config) as cluster:
            schedule = Schedule()
            assert cluster.router is not None
            router = psutil.Process(cluster.router.process.pid)
            peak_rss = [router.memory_info().rss]

            async def go() -> tuple[list[Outcome], list[RequestRecord], float]:
                load = asyncio.create_task(drive(cluster.address, prompts, params, args))
                while not load.done() and scenario:
                    faults = asyncio.to_thread(
                        SCENARIOS[scenario], cluster, redis, STALL_S, duration_s, args.seed
                    )
                    schedule.faults.extend((await faults).faults)
                    break
                while not load.done():  # the router's RSS while the load runs
                    peak_rss.append(router.memory_info().rss)
                    await asyncio.wait([load], timeout=0.5)
                return await load

            duration_s = args.requests / args.rate
            outcomes, records, duration_s = asyncio.run(go())
            leaked = asyncio.run(leaked_blocks(cluster))
            lines = router_metrics(cluster)
            restarts = cluster.num_restarts
    identical = near_tie = failed = 0
    for outcome, ref, prompt, p in zip(outcomes, references, prompts, params, strict=True):
        if outcome.hung or outcome.error:
            failed += not outcome.hung
            continue
        if outcome.token_ids == ref.token_ids:
            identical += 1
            continue
        at = first_difference(outcome.token_ids, ref.token_ids)
        if sampler_choice(llm.engine, prompt, ref.token_ids, at, p).margin <= NEAR_TIE:
            near_tie += 1
        else:
            failed += 1
    summary = summarize(records, duration_s, None, None)
    return {
        "requests": len(prompts),
        "completed_identical": identical,
        "completed_near_tie": near_tie,
        "failed": failed,
        "hung": sum(o.hung for o in outcomes),
        "migrations": migrations(lines),
        "leaked_blocks": leaked,
        "workers_restarted": restarts,
        "ttft_p50_s": summary.ttft_s.p50,
        "ttft_p99_s": summary.ttft_s.p99,
        "tpot_p50_s": summary.tpot_s.p50,
        "tpot_p99_s": summary.tpot_s.p99,
        "migration_extra_p99_s": migration_extra_p99_s(outcomes, records),
        "migrated_streams": sum(o.num_migrations > 0 for o in outcomes),
        "router_peak_rss_mb": round(max(peak_rss) / 2**20, 1),
        "faults": [_fault_text(f) for f in schedule.faults],
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }


def _fault_text(fault: Fault) -> str:
    if not fault.timed:
        return fault.what
    seen = "not detected" if fault.detection_s is None else f"{fault.detection_s:.2f} s"
    return f"{fault.what} ({seen})"


KEYS = [
    "completed_identical",
    "completed_near_tie",
    "failed",
    "hung",
    "migrations",
    "migrated_streams",
    "leaked_blocks",
    "workers_restarted",
    "router_peak_rss_mb",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "migration_extra_p99_s",
]


def main() -> None:
    args = parse_args()
    model_dir = ensure_model(args)
    llm = LLM(str(model_dir))
    scenarios = args.scenarios.split(",")
    results = {name: run(model_dir, llm, args, name) for name in scenarios}
    baseline = run(model_dir, llm, args, "")
    print(f"\n{args.requests} requests at {args.rate}/s on 2 prefill + 2 decode ({model_dir.name})")
    print(f"router stall timeout {STALL_S:g} s (the default)")
    for name in scenarios:
        print(f"{name}: " + "; ".join(results[name]["faults"]))
    print(f"{'':<24}" + "".join(f"{n:>22}" for n in [*scenarios, "baseline"]))
    for key in KEYS:
        fmt = (lambda v: f"{v * 1e3:.1f}ms") if key.endswith("_s") else str
        row = [results[n][key] for n in scenarios] + [baseline[key]]
        print(f"{key:<24}" + "".join(f"{fmt(v):>22}" for v in row))
    ok = all(r["failed"] == r["hung"] == r["leaked_blocks"] == 0 for r in results.values())
    print(f"goal (0 failed, 0 hung, 0 leaked under faults): {'met' if ok else 'MISSED'}")
    for name in scenarios:
        if results[name]["errors"]:
            print(f"{name} errors: " + " | ".join(results[name]["errors"]))
    report: dict[str, Any] = {"benchmark": "chaos", "stall_timeout_s": STALL_S}
    for name in scenarios:
        report[name] = {k: v for k, v in results[name].items() if k != "errors"}
    report["baseline"] = {k: v for k, v in baseline.items() if k not in ("faults", "errors")}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
