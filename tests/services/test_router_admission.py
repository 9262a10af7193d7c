"""A decode worker without room: the router rejects or queues, with a bound, and never hangs."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from app.client import GenerateResult, generate
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.service import RouterService
from tests.services.harness import (
    both_sides_freed,
    start,
    start_decode,
    start_prefill,
)


def test_decode_without_room_rejects_or_queues_never_hangs(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1024) for _ in range(60)] for _ in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = make_llm(llama_dir).generate(prompts, params)

    async def run() -> None:
        _, prefill_server = await start_prefill(llama_dir)
        # 8 blocks of 16 tokens: one 60-token prompt takes 4, so at most two fit at once.
        _, decode_server = await start_decode(llama_dir, num_blocks=8, peers=[prefill_server])
        router = RouterService(
            RouterConfig(
                model=str(llama_dir),
                prefill_addresses=(prefill_server.address,),
                decode_addresses=(decode_server.address,),
                admission_timeout_s=1.0,
                local_prefill_tokens=0,
            )
        )
        router_server = await start(router)
        channel = grpc.aio.insecure_channel(router_server.address)
        stub = router_pb2_grpc.RouterStub(channel)
        sampling = common_pb2.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        try:
            # Can never fit (13 blocks > 8): rejected at once, not queued.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(
                    stub,
                    router_pb2.GenerateRequest(prompt_token_ids=[5] * 200, sampling=sampling),
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "200 prompt tokens" in (err.value.details() or "")

            async def one(prompt: list[int]) -> GenerateResult | grpc.aio.AioRpcError:
                request = router_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
                try:
                    return await generate(stub, request)
                except grpc.aio.AioRpcError as exc:
                    return exc

            async with asyncio.timeout(120):  # the bound: a hang fails here
                results = await asyncio.gather(*(one(p) for p in prompts))
            num_ok = 0
            for result, expected in zip(results, reference, strict=True):
                if isinstance(result, GenerateResult):
                    assert result.token_ids == expected.token_ids
                    num_ok += 1
                else:
                    assert result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, result
                    assert "admission_timeout_s" in (result.details() or "")
            assert num_ok >= 2
            await both_sides_freed(prefill_server, decode_server)
        finally:
            await channel.close()
            await router_server.shutdown()
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())
