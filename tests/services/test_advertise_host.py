"""A worker bound to every interface (a pod) names its advertised host in the KV handles it
hands out, never 0.0.0.0, and decode workers pull through that address."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdserve.common.server import ServerConfig
from tests.services.harness import (
    both_sides_freed,
    decode_stub,
    prefilled_request,
    start_decode,
    start_prefill,
)
from tests.services.test_transfer_failures import PARAMS, PROMPT


def test_kv_handle_names_the_advertised_host(llama_dir: Path) -> None:
    async def run() -> None:
        server = ServerConfig(host="0.0.0.0", advertise_host="127.0.0.1", insecure=True)
        _, prefill_server = await start_prefill(llama_dir, server=server)
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        try:
            request = await prefilled_request(prefill_server, PROMPT, PARAMS)
            assert request.handle.address.startswith("127.0.0.1:")
            stream = decode_stub(decode_server).Decode(request)
            tokens = [t async for r in stream for t in r.tokens.token_ids]
            assert len(tokens) == PARAMS.max_tokens - 1  # the first came from prefill
            await both_sides_freed(prefill_server, decode_server)
        finally:
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())
