"""The cost policy routes a prompt to a worker that pulls its prefix (docs/kv-cache.md), end
to end: router, real Redis index, two prefill workers, a decode worker. Worker B caches the
prompt's prefix but its cache is too small for the whole prompt; the plan sends the request to
A with B as the holder; A pulls B's blocks, computes only the rest, and the client gets one
engine's tokens."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc

from app.client import generate
from engine import SamplingParams
from engine.block_hash import hash_blocks, root_hash
from engine.fingerprint import fingerprint_of
from native_engine import LLM
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.v1 import common_pb2, prefill_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.policy import RoutingPolicy
from router.service import RouterService
from tests.services.harness import (
    both_sides_freed,
    prefill_stub,
    start,
    start_decode,
    start_prefill,
    wait_for,
)

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_the_plan_sends_a_prompt_to_a_worker_that_pulls_its_prefix(
    llama_dir: Path, redis_url: str, make_llm: Callable[..., LLM]
) -> None:
    rng = random.Random(39)
    prefix = [rng.randrange(3, 1024) for _ in range(18 * BS)]
    prompt = prefix + [rng.randrange(3, 1024) for _ in range(200)]  # 31 blocks: not B's 24
    want = make_llm(llama_dir).generate([prompt], PARAMS)[0].token_ids

    async def run() -> None:
        redis = RedisConfig(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
        a, a_server = await start_prefill(llama_dir, redis=redis)
        b, b_server = await start_prefill(llama_dir, num_blocks=24, redis=redis)
        _, d_server = await start_decode(llama_dir, redis=redis)
        config = RouterConfig(
            model=str(llama_dir),
            redis=redis,
            prefill_policy=RoutingPolicy.COST,
            local_prefill_tokens=0,
        )
        router_server = await start(RouterService(config))
        index = RedisPrefixIndex.from_url(redis_url, redis.namespace)
        try:
            # B computes the prefix (and one token more), then its lease ends: cached there.
            sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
            done = await prefill_stub(b_server).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="warm", prompt_token_ids=[*prefix, 5], sampling=sampling
                )
            )
            await prefill_stub(b_server).Release(
                prefill_pb2.ReleaseRequest(request_id="warm", lease_token=done.lease.lease_token)
            )
            keys = hash_blocks(root_hash(fingerprint_of(llama_dir, "float32", BS)), prefix, BS)

            async def indexed() -> bool:
                found = await index.longest_prefixes(keys, [b.worker_id])
                return found[b.worker_id] == len(keys)

            await wait_for(indexed, 30.0, "B's prefix published to the index")
            async with grpc.aio.insecure_channel(router_server.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                request = router_pb2.GenerateRequest(
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(
                        max_tokens=PARAMS.max_tokens, temperature=0.0, ignore_eos=True
                    ),
                )
                result = await generate(stub, request)
            assert result.token_ids == want
            stats = await prefill_stub(a_server).GetStats(common_pb2.GetStatsRequest())
            assert stats.num_prompt_tokens_computed == 200  # the prefix came from B
            assert stats.num_prefix_hit_tokens == 18 * BS
            await both_sides_freed(a_server, d_server)
            await both_sides_freed(b_server, d_server)
            assert not a.leases and not b.leases
        finally:
            await index.close()
            await router_server.shutdown()
            for server in (d_server, a_server, b_server):
                await server.shutdown()

    asyncio.run(run())
