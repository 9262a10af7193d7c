"""A worker's presence in Redis: it registers, publishes its cache, and republishes it after
Redis loses its data without any connection error (a fast restart)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from engine import SamplingParams
from pdserve.cluster.config import RedisConfig, connect
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
