"""The host tier under faults: Redis killed and restarted empty while a worker's prefixes sit
in its host tier (the worker republishes that tier with its device tier, and the router can
credit it again), and a client gone while its prompt is loading from the host tier (the blocks
come back once the copy lands)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.embedded_redis import EmbeddedRedis
from engine import SamplingParams
from engine.block_hash import hash_blocks, root_hash
from engine.fingerprint import fingerprint_of
from native_engine.builder import build_native_engine
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.prefix_index import ANY_TIER
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from prefill_service.config import PrefillConfig
from prefill_service.service import PrefillService
from tests.services.harness import all_blocks_free, engine_config, prefill_stub, start, wait_for

BS = 16
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:  # its own server: the test kills and restarts it
        yield server


def _tiered_config(llama_dir: Path, redis: RedisConfig | None) -> PrefillConfig:
    small = engine_config(llama_dir, num_blocks=12)
    cache = dataclasses.replace(small.cache, host_cache_gib=0.05)
    return PrefillConfig(engine=dataclasses.replace(small, cache=cache), redis=redis)


async def _evict_to_host(service: PrefillService, prefix: list[int], rng: random.Random) -> None:
    fillers = [[rng.randrange(3, 1024) for _ in range(150)] for _ in range(2)]
    for prompt in ([*prefix, 7], *fillers):
        async for _ in service.engine.generate(uuid.uuid4().hex, prompt, PARAMS):
            pass


def test_redis_restarted_empty_gets_the_host_tier_republished(
    llama_dir: Path, redis: EmbeddedRedis
) -> None:
    async def scenario() -> None:
        config = RedisConfig(url=redis.url, namespace="host-tier", ttl_s=2.0, heartbeat_s=0.2)
        service = PrefillService(_tiered_config(llama_dir, config), build_native_engine)
        server = await start(service)
        rng = random.Random(1)
        prefix = [rng.randrange(3, 1024) for _ in range(4 * BS)]
        keys = hash_blocks(root_hash(fingerprint_of(llama_dir, "float32", BS)), prefix, BS)
        worker = service.worker_id

        async def in_the_host_tier() -> bool:
            index = RedisPrefixIndex.from_url(redis.url, "host-tier")
            try:
                return (await index.longest_prefixes(keys, [worker], ANY_TIER))[worker] == 4
            except OSError:
                return False
            finally:
                await index.close()

        try:
            await _evict_to_host(service, prefix, rng)
            await wait_for(in_the_host_tier, 30.0, "the host tier published")
            redis.stop()
            redis.start()  # empty, same port
            await wait_for(in_the_host_tier, 30.0, "the host tier republished after the restart")
        finally:
            await server.shutdown()

    asyncio.run(scenario())


def test_a_client_gone_while_its_prompt_loads_frees_every_block(llama_dir: Path) -> None:
    async def scenario() -> None:
        service = PrefillService(_tiered_config(llama_dir, None), build_native_engine)
        server = await start(service)
        rng = random.Random(2)
        prefix = [rng.randrange(3, 1024) for _ in range(6 * BS)]
        try:
            await _evict_to_host(service, prefix, rng)
            llm_engine = service.engine._engine
            tier = llm_engine.host_tier
            assert tier is not None
            # Fault injection: the copy in is slow (held until the client has left), so the
            # request is surely loading when its client leaves; then the copy lands.
            gate = threading.Event()
            copy_in = tier._copy_in

            def slow_copy_in(pairs: list[tuple[int, int]]) -> None:
                gate.wait(30.0)
                copy_in(pairs)

            tier._copy_in = slow_copy_in  # type: ignore[method-assign]

            async def consume() -> None:
                async for _ in service.engine.generate("gone", [*prefix, 9], PARAMS):
                    pass

            client = asyncio.ensure_future(consume())

            async def loading() -> bool:
                return "gone" in llm_engine.host_loads.loading

            await wait_for(loading, 30.0, "the prompt loading from the host tier")
            client.cancel()  # the client leaves mid-load
            await asyncio.gather(client, return_exceptions=True)
            gate.set()
            await wait_for(lambda: all_blocks_free(prefill_stub(server)), 30.0, "blocks freed")
            assert not llm_engine.host_loads.loading and not llm_engine.has_unfinished_requests()
        finally:
            await server.shutdown()

    asyncio.run(scenario())
