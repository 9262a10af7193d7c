"""The host tier seen by the cluster: a prefill worker whose device cache evicted a prefix to
its host tier publishes it (tier "host") to the Redis index, and the cache-aware router sends
the next prompt with that prefix to it, not to an idle worker without it; there the prefix is
loaded, not recomputed."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from pathlib import Path

import grpc

from app.client import generate
from engine import SamplingParams
from engine.block_hash import hash_blocks, root_hash
from engine.fingerprint import fingerprint_of
from native_engine.builder import build_native_engine
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.prefix_index import ANY_TIER
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from prefill_service.config import PrefillConfig
from prefill_service.service import PrefillService
from router.config import RouterConfig
from router.policy import RoutingPolicy
from router.service import RouterService
from tests.services.harness import engine_config, start, start_decode, start_prefill, wait_for

BS = 16


async def _scenario(llama_dir: Path, redis_url: str) -> None:
    redis = RedisConfig(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    small = engine_config(llama_dir, num_blocks=12)  # 192 tokens on the device
    tiered = dataclasses.replace(small, cache=dataclasses.replace(small.cache, host_cache_gib=0.05))
    service_a = PrefillService(PrefillConfig(engine=tiered, redis=redis), build_native_engine)
    server_a = await start(service_a)
    service_b, server_b = await start_prefill(llama_dir, redis=redis)
    _, decode_server = await start_decode(llama_dir, redis=redis)
    router_server = await start(
        RouterService(
            RouterConfig(
                model=str(llama_dir),
                redis=redis,
                prefill_policy=RoutingPolicy.CACHE_AWARE,
                local_prefill_tokens=0,
            )
        )
    )
    index = RedisPrefixIndex.from_url(redis_url, redis.namespace)
    rng = random.Random(5)
    prefix = [rng.randrange(3, 1024) for _ in range(6 * BS)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        # On A alone: the prefix, then two prompts that push it out of A's device cache.
        fillers = [[rng.randrange(3, 1024) for _ in range(150)] for _ in range(2)]
        for prompt in ([*prefix, 7], *fillers):
            async for _ in service_a.engine.generate(uuid.uuid4().hex, prompt, params):
                pass
        keys = hash_blocks(root_hash(fingerprint_of(llama_dir, "float32", BS)), prefix, BS)
        a = service_a.worker_id

        async def only_in_the_host_tier() -> bool:
            device = await index.longest_prefixes(keys, [a])
            either = await index.longest_prefixes(keys, [a], ANY_TIER)
            return device[a] < len(keys) and either[a] == len(keys)

        await wait_for(only_in_the_host_tier, 30.0, "the prefix published in A's host tier")
        before = service_a.engine.stats.num_host_hit_tokens
        sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        request = router_pb2.GenerateRequest(prompt_token_ids=[*prefix, 9, 10], sampling=sampling)
        async with grpc.aio.insecure_channel(router_server.address) as channel:
            await generate(router_pb2_grpc.RouterStub(channel), request)
        assert service_b.engine.stats.num_prompt_tokens_computed == 0  # B was never chosen
        assert service_a.engine.stats.num_host_hit_tokens > before  # loaded, not recomputed
    finally:
        await index.close()
        await router_server.shutdown()
        await decode_server.shutdown()
        await server_b.shutdown()
        await server_a.shutdown()


def test_the_router_prefers_a_host_tier_hit_over_a_miss(llama_dir: Path, redis_url: str) -> None:
    asyncio.run(_scenario(llama_dir, redis_url))
