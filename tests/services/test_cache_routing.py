"""Cache-aware prefill routing against a real Redis: with two prefill workers and a shared-prefix
workload, cache_aware computes far fewer prompt tokens than round_robin (counted, not timed)."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

import grpc

from app.client import generate
from engine.block_hash import hash_blocks, root_hash
from engine.fingerprint import fingerprint_of
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.policy import RoutingPolicy
from router.service import RouterService
from tests.services.harness import prefill_stub, start, start_decode, start_prefill, wait_for

# An odd number of prefixes, so that round-robin does not happen to line up with them.
NUM_PREFIXES, TURNS, PREFIX_LEN, SUFFIX_LEN, BS = 3, 4, 64, 8, 16


async def _prefill_tokens(policy: RoutingPolicy, llama_dir: Path, redis_url: str) -> int:
    redis = RedisConfig(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    prefills = [await start_prefill(llama_dir, redis=redis) for _ in range(2)]
    _, decode_server = await start_decode(llama_dir, redis=redis)
    router_server = await start(
        RouterService(
            RouterConfig(
                model=str(llama_dir), redis=redis, prefill_policy=policy, local_prefill_tokens=0
            )
        )
    )
    index = RedisPrefixIndex.from_url(redis_url, redis.namespace)
    worker_ids = [service.worker_id for service, _ in prefills]
    root = root_hash(fingerprint_of(llama_dir, "float32", BS))
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 1024) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        async with grpc.aio.insecure_channel(router_server.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for turn in range(TURNS):
                for prefix in prefixes:
                    suffix = [rng.randrange(3, 1024) for _ in range(SUFFIX_LEN)]
                    request = router_pb2.GenerateRequest(
                        prompt_token_ids=prefix + suffix, sampling=sampling
                    )
                    await generate(stub, request)
                    if turn > 0:
                        continue
                    # Later turns must find this prefix: wait (bounded) until it is published.
                    keys = hash_blocks(root, prefix, BS)

                    async def indexed(keys: list[bytes] = keys) -> bool:
                        found = await index.longest_prefixes(keys, worker_ids)
                        return max(found.values()) == len(keys)

                    await wait_for(indexed, 30.0, "prefix published to the index")
        total = 0
        for _, server in prefills:
            stats = await prefill_stub(server).GetStats(common_pb2.GetStatsRequest())
            total += stats.num_prompt_tokens_computed
        return total
    finally:
        await index.close()
        await router_server.shutdown()
        await decode_server.shutdown()
        for _, server in prefills:
            await server.shutdown()


def test_cache_aware_computes_far_fewer_prefill_tokens(llama_dir: Path, redis_url: str) -> None:
    cache_aware = asyncio.run(_prefill_tokens(RoutingPolicy.CACHE_AWARE, llama_dir, redis_url))
    round_robin = asyncio.run(_prefill_tokens(RoutingPolicy.ROUND_ROBIN, llama_dir, redis_url))
    # Ideal: each prefix computed once, then only the suffixes.
    ideal = NUM_PREFIXES * PREFIX_LEN + NUM_PREFIXES * TURNS * SUFFIX_LEN
    assert cache_aware <= 1.1 * ideal, (cache_aware, ideal)
    assert round_robin >= 1.5 * cache_aware, (round_robin, cache_aware)
