"""A client that goes away while its prompt is still being prefilled: the router cancels the
Prefill call and the prefill worker aborts the request and frees its blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.service import RouterService
from tests.services.harness import (
    all_blocks_free,
    decode_stub,
    prefill_stub,
    start,
    start_decode,
    start_prefill,
    wait_for,
)


def test_cancel_during_prefill_aborts_it_on_the_worker(llama_dir: Path) -> None:
    async def run() -> None:
        # 4-token chunks: a 500-token prompt takes 125 steps, long enough to cancel mid-way.
        _, prefill_server = await start_prefill(llama_dir, max_num_batched_tokens=4)
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        router_server = await start(
            RouterService(
                RouterConfig(
                    model=str(llama_dir),
                    prefill_addresses=(prefill_server.address,),
                    decode_addresses=(decode_server.address,),
                )
            )
        )
        prefill = prefill_stub(prefill_server)
        try:
            async with grpc.aio.insecure_channel(router_server.address) as channel:
                request = router_pb2.GenerateRequest(
                    prompt_token_ids=list(range(1, 501)),
                    sampling=common_pb2.SamplingParams(max_tokens=4),
                )
                call = router_pb2_grpc.RouterStub(channel).Generate(request)

                async def prefilling() -> bool:
                    stats = await prefill.GetStats(common_pb2.GetStatsRequest())
                    return stats.num_running == 1 and stats.num_free_blocks < stats.num_blocks

                await wait_for(prefilling, 30.0, "prefill under way")
                call.cancel()
            await wait_for(lambda: all_blocks_free(prefill), 30.0, "prefill blocks freed")
            assert await all_blocks_free(decode_stub(decode_server))
            stats = await prefill.GetStats(common_pb2.GetStatsRequest())
            assert stats.num_prompt_tokens_computed < 500  # it stopped before the end
        finally:
            await router_server.shutdown()
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())
