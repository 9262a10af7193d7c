"""Prefix-aware routing: shared system prompts against two prefill workers (CPU).

``--prompts`` long system prompts x ``--turns`` user turns (each request = one system prompt + a
fresh user message), sent in rounds of one request per system prompt (shuffled), concurrently.
The same workload runs on two local clusters (router + 2 prefill + 1 decode, embedded Redis) in
one run: ``--prefill-policy cache_aware`` and ``round_robin``. Every request is disaggregated
(no local prefill), so the prefill pool computes every uncached prompt token.

Reported per policy: prefill tokens computed (the prefill workers' own counters) / ideal, where
ideal computes each system prompt once and every user message once; TTFT p50/p90.
Goal: cache_aware <= 1.1x ideal. Also the router's index lookup per request on a real Redis
(8 workers holding device and host-tier blocks, a 128-block prompt): ``prefix_hits`` (one
round trip) against its baseline, two ``longest_prefixes`` calls. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench_inputs import ensure_model, prefill_tokens_computed  # sibling module

from app.client import GenerateResult, generate, router_channel
from app.embedded_redis import EmbeddedRedis
from app.local_cluster import ClusterConfig, LocalCluster
from engine.block_hash import hash_blocks, root_hash
from engine.kv_events import CacheTier, KVEvents
from pdserve.cluster.prefix_index import ANY_TIER
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

GOAL = 1.1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--prompts", type=int, default=8, help="distinct system prompts (8)")
    p.add_argument("--turns", type=int, default=32, help="user turns per system prompt (32)")
    p.add_argument("--system-len", type=int, default=256, help="system prompt tokens (256)")
    p.add_argument("--user-len", type=int, default=16, help="user message tokens (16)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny", help="checkpoint size")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.turns = 3, 4
    return args


async def _run_workload(address: str, args: argparse.Namespace) -> list[GenerateResult]:
    rng = random.Random(0)
    systems = [
        [rng.randrange(3, 1024) for _ in range(args.system_len)] for _ in range(args.prompts)
    ]
    sampling = common_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
    )
    results: list[GenerateResult] = []
    async with router_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for _ in range(args.turns):
            requests = [
                router_pb2.GenerateRequest(
                    prompt_token_ids=system
                    + [rng.randrange(3, 1024) for _ in range(args.user_len)],
                    sampling=sampling,
                )
                for system in systems
            ]
            results += await asyncio.gather(*(generate(stub, r) for r in requests))
    return results


def run_policy(policy: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    with EmbeddedRedis() as redis:
        config = ClusterConfig(
            model=str(model_dir),
            num_prefill=2,
            num_decode=1,
            redis_url=redis.url,
            log_level="WARNING",
            router_args=("--prefill-policy", policy, "--local-prefill-tokens", "0"),
        )
        with LocalCluster(config) as cluster:
            start = time.perf_counter()
            results = asyncio.run(_run_workload(cluster.address, args))
            wall_s = time.perf_counter() - start
            computed = asyncio.run(prefill_tokens_computed(cluster))
    ideal = args.prompts * args.system_len + args.prompts * args.turns * args.user_len
    ttft = sorted(r.ttft_s for r in results)
    return {
        "policy": policy,
        "requests": len(results),
        "prefill_tokens": computed,
        "ideal_tokens": ideal,
        "over_ideal": computed / ideal,
        "cached_tokens": sum(r.cached_tokens for r in results),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "wall_s": wall_s,
    }


async def _lookup_costs(url: str, num_repeats: int) -> dict[str, float]:
    """Median seconds per routing lookup: both tiers in one call, and as two calls."""
    index = RedisPrefixIndex.from_url(url, namespace="bench-lookup")
    hashes = hash_blocks(root_hash("bench"), list(range(128 * 16)), 16)
    workers = [f"w{i}" for i in range(8)]
    try:
        for i, w in enumerate(workers):  # worker i: 16 i device blocks, then 40 on the host
            await index.apply(w, KVEvents(stored=hashes[: 16 * i], removed=[]))
            host = hashes[16 * i : 16 * i + 40]
            await index.apply(w, KVEvents(stored=host, removed=[], tier=CacheTier.HOST))

        async def one_call() -> None:
            await index.prefix_hits(hashes, workers)

        async def two_calls() -> None:
            await index.longest_prefixes(hashes, workers)
            await index.longest_prefixes(hashes, workers, ANY_TIER)

        costs: dict[str, list[float]] = {"prefix_hits_s": [], "two_lookups_s": []}
        for _ in range(num_repeats):  # interleaved: both see the same machine
            for name, lookup in (("prefix_hits_s", one_call), ("two_lookups_s", two_calls)):
                start = time.perf_counter()
                await lookup()
                costs[name].append(time.perf_counter() - start)
        return {name: statistics.median(times[10:]) for name, times in costs.items()}
    finally:
        await index.close()


def main() -> None:
    args = parse_args()
    model_dir = ensure_model(args)
    rows = [run_policy(policy, model_dir, args) for policy in ("cache_aware", "round_robin")]
    print(
        f"\n{args.prompts} system prompts x {args.turns} turns, {args.system_len}+{args.user_len}"
        f" tokens, 2 prefill workers, {model_dir.name}"
    )
    print(f"{'policy':<12} {'prefill tok':>11} {'x ideal':>8} {'TTFT p50':>9} {'TTFT p90':>9}")
    for r in rows:
        print(
            f"{r['policy']:<12} {r['prefill_tokens']:>11} {r['over_ideal']:>8.2f} "
            f"{r['ttft_p50_s'] * 1e3:>7.1f}ms {r['ttft_p90_s'] * 1e3:>7.1f}ms"
        )
    with EmbeddedRedis() as redis:
        lookup = asyncio.run(_lookup_costs(redis.url, 60 if args.quick else 500))
    lookup["ratio"] = lookup["prefix_hits_s"] / lookup["two_lookups_s"]
    print(
        f"index lookup: prefix_hits {lookup['prefix_hits_s'] * 1e3:.3f} ms, two lookups "
        f"{lookup['two_lookups_s'] * 1e3:.3f} ms ({lookup['ratio']:.2f}x)"
    )
    cache_aware, round_robin = rows
    verdict = "ok" if cache_aware["over_ideal"] <= GOAL else "ABOVE GOAL"
    print(f"cache_aware = {cache_aware['over_ideal']:.2f}x ideal (goal <= {GOAL}): {verdict}")
    report = {
        "cache_aware_over_ideal": cache_aware["over_ideal"],
        "round_robin_over_ideal": round_robin["over_ideal"],
        "round_robin_over_cache_aware": round_robin["prefill_tokens"]
        / cache_aware["prefill_tokens"],
        "ttft_p50_ratio_rr_over_ca": round_robin["ttft_p50_s"] / cache_aware["ttft_p50_s"],
        "runs": rows,
        "index_lookup": lookup,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
