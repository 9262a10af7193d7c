"""A decode worker forgets prefill peers that left the cluster: their control channels and
what its KV receiver kept for their senders go once the registry no longer lists them and
they stop answering (before, every peer ever seen stayed: channels, NIXL agents, locks)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServiceServer
from tests.services.harness import disaggregated, start_decode, start_prefill, wait_for
from tests.services.test_transfer_failures import PARAMS, PROMPT


async def _disaggregated(prefill: ServiceServer, decode: ServiceServer, request_id: str) -> None:
    tokens = await disaggregated(prefill, decode, PROMPT, PARAMS, request_id)
    assert len(tokens) == PARAMS.max_tokens - 1  # the first came from prefill


def test_a_departed_prefill_peer_is_forgotten(llama_dir: Path, redis_url: str) -> None:
    redis = RedisConfig(url=redis_url, namespace=f"departed-{uuid.uuid4().hex[:8]}")

    async def run() -> None:
        _, staying = await start_prefill(llama_dir, redis=redis)
        _, leaving = await start_prefill(llama_dir, redis=redis)
        decode, decode_server = await start_decode(llama_dir, redis=redis)
        try:
            await _disaggregated(staying, decode_server, "a")
            await _disaggregated(leaving, decode_server, "b")
            channels = decode._channels._channels  # control channels, by prefill address
            receiver = decode._receiver._channels._channels  # type: ignore[union-attr]
            kv_leaving = leaving.service.kv_address  # type: ignore[attr-defined]
            assert leaving.service.address in channels and kv_leaving in receiver
            await leaving.shutdown()  # deregisters, then stops answering

            async def forgotten() -> bool:
                return leaving.service.address not in channels and kv_leaving not in receiver

            await wait_for(forgotten, 60.0, "the decode worker forgets the departed peer")
            assert staying.service.address in channels
            await _disaggregated(staying, decode_server, "c")  # the rest still serve
        finally:
            await decode_server.shutdown()
            await staying.shutdown()

    asyncio.run(run())
