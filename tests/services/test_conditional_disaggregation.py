"""Conditional disaggregation: a prompt with a short uncached part is prefilled on the decode
worker (no transfer); a long one is disaggregated. Both give one engine's tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import grpc

from app.client import generate
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.service import RouterService
from tests.services.harness import (
    decode_stub,
    prefill_stub,
    start,
    start_decode,
    start_prefill,
    wait_for,
)


def test_short_prompts_prefill_on_decode_long_ones_disaggregate(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    rng = random.Random(5)
    short, long = (
        [rng.randrange(3, 1024) for _ in range(20)],
        [rng.randrange(3, 1024) for _ in range(80)],
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = make_llm(llama_dir).generate([short, long], params)

    async def run() -> None:
        _, prefill_server = await start_prefill(llama_dir)
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        router_server = await start(
            RouterService(
                RouterConfig(
                    model=str(llama_dir),
                    prefill_addresses=(prefill_server.address,),
                    decode_addresses=(decode_server.address,),
                    local_prefill_tokens=32,
                )
            )
        )
        sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        stats = common_pb2.GetStatsRequest()
        try:
            async with grpc.aio.insecure_channel(router_server.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                got_short = await generate(
                    stub, router_pb2.GenerateRequest(prompt_token_ids=short, sampling=sampling)
                )
                decode_after_short = await decode_stub(decode_server).GetStats(stats)
                prefill_after_short = await prefill_stub(prefill_server).GetStats(stats)
                got_long = await generate(
                    stub, router_pb2.GenerateRequest(prompt_token_ids=long, sampling=sampling)
                )
                decode_after_long = await decode_stub(decode_server).GetStats(stats)
                prefill_after_long = await prefill_stub(prefill_server).GetStats(stats)
        finally:
            await router_server.shutdown()
            await decode_server.shutdown()
            await prefill_server.shutdown()
        assert got_short.token_ids == reference[0].token_ids
        assert got_long.token_ids == reference[1].token_ids
        # 20 uncached tokens < 32: the decode worker prefilled them, no transfer.
        assert decode_after_short.num_prompt_tokens_computed == 20
        assert prefill_after_short.num_prompt_tokens_computed == 0
        assert got_short.transfer_s == 0.0
        # 80 tokens: disaggregated; the decode worker computed no further prompt token.
        assert prefill_after_long.num_prompt_tokens_computed == 80
        assert decode_after_long.num_prompt_tokens_computed == 20
        assert got_long.transfer_s > 0.0

    asyncio.run(run())


def test_colocated_router_takes_a_request_turned_away_to_the_next_worker(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """Colocated: no prefill pool. A worker that answers UNAVAILABLE (draining) does not fail
    the request; the next worker serves it."""
    from pdserve.common import metrics
    from router.policy import RoutingPolicy

    prompts = [[9 + i] * (10 + i) for i in range(2)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reference = make_llm(llama_dir).generate(prompts, params)
    decisions = metrics.ROUTING_DECISIONS.labels("decode", "colocated", "colocated")

    async def run() -> None:
        draining, draining_server = await start_decode(llama_dir)
        _, healthy_server = await start_decode(llama_dir)
        router = RouterService(
            RouterConfig(
                model=str(llama_dir),
                decode_addresses=(draining_server.address, healthy_server.address),
                decode_policy=RoutingPolicy.ROUND_ROBIN,  # both workers get turns
                colocated=True,
                stats_interval_s=3600.0,  # after its first round, no stats refresh for an hour
            )
        )
        router_server = await start(router)
        watched = router.pool.decode[draining_server.address]
        loaded_stats = watched.stats

        async def first_round_done() -> bool:
            return watched.stats is not loaded_stats

        await wait_for(first_round_done, 30.0, "the router's first stats round")
        draining.draining = True  # refuses new work with UNAVAILABLE; the router cannot know
        sampling = common_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        before = decisions._value.get()
        try:
            async with grpc.aio.insecure_channel(router_server.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                results = [
                    await generate(
                        stub, router_pb2.GenerateRequest(prompt_token_ids=p, sampling=sampling)
                    )
                    for p in prompts
                ]
            stats = common_pb2.GetStatsRequest()
            turned_away = await decode_stub(draining_server).GetStats(stats)
            served = await decode_stub(healthy_server).GetStats(stats)
        finally:
            await router_server.shutdown()
            await healthy_server.shutdown()
            draining.draining = False
            await draining_server.shutdown()
        assert [r.token_ids for r in results] == [e.token_ids for e in reference]
        assert turned_away.num_prompt_tokens_computed == 0
        assert served.num_prompt_tokens_computed == sum(len(p) for p in prompts)
        # Round robin over two workers: at least one request met the draining one first.
        assert decisions._value.get() - before >= len(prompts) + 1

    asyncio.run(run())
