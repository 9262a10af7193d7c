"""A worker bound to every interface (a pod) names its advertised host in the KV handles it
hands out, never 0.0.0.0, and decode workers pull through that address."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdserve.common.server import ServerConfig
from tests.services.harness import both_sides_freed, start_decode, start_prefill
from tests.services.test_transfer_failures import PARAMS, PROMPT


def test_kv_handle_names_the_advertised_host(llama_dir: Path) -> None:
    from pdserve.common.convert import sampling_to_proto
    from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    async def run() -> None:
        server = ServerConfig(host="0.0.0.0", advertise_host="127.0.0.1", insecure=True)
        _, prefill_server = await start_prefill(llama_dir, server=server)
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        sampling = sampling_to_proto(PARAMS)
        try:
            import grpc

            async with grpc.aio.insecure_channel(prefill_server.address) as channel:
                prefilled = await prefill_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="r", prompt_token_ids=PROMPT, sampling=sampling
                    )
                )
            assert prefilled.handle.address.startswith("127.0.0.1:")
            request = decode_pb2.DecodeRequest(
                request_id="r", prompt_token_ids=PROMPT, sampling=sampling,
                first_token_id=prefilled.first_token_id, handle=prefilled.handle,
                prefill_address=prefill_server.service.address,
            )  # fmt: skip
            async with grpc.aio.insecure_channel(decode_server.address) as channel:
                stream = decode_pb2_grpc.DecodeWorkerStub(channel).Decode(request)
                tokens = [t async for r in stream for t in r.token_ids]
            assert len(tokens) == PARAMS.max_tokens - 1  # the first came from prefill
            await both_sides_freed(prefill_server, decode_server)
        finally:
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())
