"""A worker's presence in Redis: it registers, publishes its cache, and republishes it after
Redis loses its data without any connection error (a fast restart), even when its newer events
reached the empty Redis first."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from engine import SamplingParams
from engine.block_hash import hash_blocks, root_hash
from engine.kv_events import CacheTier, KVEvents
from pdserve.cluster.config import RedisConfig, connect
from pdserve.cluster.prefix_index import ANY_TIER
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.cluster.registry import Registry, WorkerState
from pdserve.cluster.status import status_table
from pdserve.common.convert import sampling_to_proto
from pdserve.common.role import Role
from pdserve.v1 import prefill_pb2
from tests.services.harness import prefill_stub, start_prefill, wait_for


def test_worker_registers_publishes_and_heals_after_redis_loses_data(
    llama_dir: Path, redis_url: str
) -> None:
    async def run() -> None:
        config = RedisConfig(url=redis_url, namespace=f"m-{uuid.uuid4().hex[:8]}")
        assert await status_table(config) == "no workers registered"
        # nixl: its sender takes longest to start (the agent, the cache registered).
        service, server = await start_prefill(llama_dir, redis=config, kv_backend="nixl")
        redis = connect(redis_url)
        registry = Registry(redis, config.namespace)
        index = RedisPrefixIndex(redis, config.namespace)
        try:

            async def registered() -> bool:
                return bool(await registry.workers())

            await wait_for(registered, 30.0, "first heartbeat")
            records = await registry.workers()
            assert [(r.worker_id, r.role, r.state) for r in records] == [
                (service.worker_id, Role.PREFILL, WorkerState.SERVING)
            ]
            assert records[0].address == server.address
            # Announced only with its KV sender: the first record already names it (decode
            # workers refuse handles from a prefill worker whose record has no KV address).
            assert records[0].kv_address == service.kv_address != ""
            request = prefill_pb2.PrefillRequest(
                request_id="r",
                prompt_token_ids=list(range(3, 70)),  # 4 full blocks
                sampling=sampling_to_proto(SamplingParams(max_tokens=1)),
            )
            await prefill_stub(server).Prefill(request)

            async def indexed() -> bool:
                return await index.num_blocks(service.worker_id) == 4

            await wait_for(indexed, 30.0, "KV events published")
            await redis.flushall()  # Redis restarted empty; the worker's connection never broke
            await wait_for(indexed, 30.0, "snapshot republished")
            assert "prefill" in await status_table(config)
        finally:
            await server.shutdown()
            # Deregistered on the way out: no record, no index entries.
            assert await registry.workers() == []
            assert await index.num_blocks(service.worker_id) == 0
            await redis.aclose()

    asyncio.run(run())


def test_a_lost_snapshot_is_seen_after_newer_events_rewrote_some_sets(redis_url: str) -> None:
    """Redis restarts empty while a worker's events are in flight: they land in the empty Redis
    first, recreating part of its sets. The snapshot's marker is what ``keep_alive`` checks, so
    the loss is still seen (before, a recreated device set read as alive, and the host tier
    published before the restart was never published again)."""
    hashes = hash_blocks(root_hash("membership"), list(range(5 * 4)), 4)
    namespace = f"m-{uuid.uuid4().hex[:8]}"

    async def run() -> None:
        index = RedisPrefixIndex.from_url(redis_url, namespace)
        try:
            snapshot = {CacheTier.DEVICE: hashes[:2], CacheTier.HOST: hashes[2:4]}
            await index.publish_snapshot("w", snapshot, ttl_s=60.0)
            assert await index.keep_alive("w", ttl_s=60.0)
            assert await index.longest_prefixes(hashes, ["w"], ANY_TIER) == {"w": 4}
            # The restart: every key of this index is gone; then a newer device event lands.
            await index.redis.delete(*await index.redis.keys(f"{namespace}:*"))
            await index.apply("w", KVEvents(stored=[hashes[4]], removed=[]))
            assert not await index.keep_alive("w", ttl_s=60.0)
            await index.publish_snapshot("w", snapshot, ttl_s=60.0)
            assert await index.keep_alive("w", ttl_s=60.0)
            assert await index.longest_prefixes(hashes, ["w"], ANY_TIER) == {"w": 4}
            keys = await index.redis.keys(f"{namespace}:*")
            assert len(keys) == 3  # two tiers and the marker, each expiring
            ttls = [await index.redis.pttl(key) for key in keys]
            assert all(0 < ttl <= 60_000 for ttl in ttls), ttls
            await index.remove_worker("w")
            assert await index.redis.keys(f"{namespace}:*") == []
        finally:
            await index.close()

    asyncio.run(run())
