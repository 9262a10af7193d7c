"""Static workers (addresses on the router's command line, no registry) are held to the same
rule as registered ones: a worker whose KV layout names another model is never routed to.
Before, a static decode worker of another model answered with its own model's tokens. The
local-prefill RPC carries the router's fingerprint too, so a worker refuses it by itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from app.client import generate
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, decode_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.policy import RoutingPolicy
from router.service import RouterService
from tests.services.harness import decode_stub, start, start_decode, wait_for

POOL = {"pool": "decode"}


def test_a_static_worker_of_another_model_is_refused_at_discovery(
    llama_dir: Path,
    model_factory: Callable[..., Path],
    make_llm: Callable[..., LLM],
    caplog: pytest.LogCaptureFixture,
) -> None:
    other_dir = model_factory("llama", seed=1)  # same shapes, other weights
    prompts = [[5 + i] * (12 + i) for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = make_llm(llama_dir).generate(prompts, params)
    caplog.set_level(logging.ERROR, logger="router.worker_pool")

    async def run() -> None:
        _, other_server = await start_decode(other_dir)
        _, good_server = await start_decode(llama_dir)
        router = RouterService(
            RouterConfig(
                model=str(llama_dir),
                # Round robin: without the check, every other request lands on the other model.
                decode_addresses=(other_server.address, good_server.address),
                decode_policy=RoutingPolicy.ROUND_ROBIN,
                colocated=True,
            )
        )
        router_server = await start(router)
        sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        try:
            other = router.pool.decode[other_server.address]

            async def refused() -> bool:
                return bool(other.refused)

            await wait_for(refused, 30.0, "the router's first stats round")
            assert not other.routable

            async def counted() -> bool:  # the gauges follow each stats round
                return REGISTRY.get_sample_value("pdserve_router_refused_workers", POOL) == 1

            # An operator sees it: refused, and not among the workers routed to.
            await wait_for(counted, 30.0, "the refused worker counted")
            assert REGISTRY.get_sample_value("pdserve_router_healthy_workers", POOL) == 1
            async with grpc.aio.insecure_channel(router_server.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                results = [
                    await generate(
                        stub, router_pb2.GenerateRequest(prompt_token_ids=p, sampling=sampling)
                    )
                    for p in prompts
                ]
            untouched = await decode_stub(other_server).GetStats(common_pb2.GetStatsRequest())
        finally:
            await router_server.shutdown()
            await good_server.shutdown()
            await other_server.shutdown()
        assert [r.token_ids for r in results] == [e.token_ids for e in reference]
        assert untouched.num_prompt_tokens_computed == 0
        messages = [r.getMessage() for r in caplog.records]
        refusals = [m for m in messages if m.startswith("refusing decode worker")]
        assert len(refusals) == 1 and other_server.address in refusals[0]

    asyncio.run(run())


def test_the_local_prefill_rpc_carries_the_layout_check(
    llama_dir: Path, model_factory: Callable[..., Path]
) -> None:
    """A caller naming another model's fingerprint is refused before any work, naming both (a
    static worker the router's stats have not refused yet cannot answer with its tokens)."""
    other_dir = model_factory("llama", seed=1)

    async def run() -> None:
        other, other_server = await start_decode(other_dir)
        mine, mine_server = await start_decode(llama_dir)
        wrong = mine.engine.fingerprint
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id="r1",
            prompt_token_ids=[5, 6, 7],
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
            model_fingerprint=wrong,
        )
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in decode_stub(other_server).PrefillAndDecode(request):
                    pass
            stats = await decode_stub(other_server).GetStats(common_pb2.GetStatsRequest())
            request.model_fingerprint = ""  # unsaid: not checked
            answers = [m async for m in decode_stub(other_server).PrefillAndDecode(request)]
        finally:
            await other_server.shutdown()
            await mine_server.shutdown()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details() or ""
        assert wrong in details and other.engine.fingerprint in details
        assert wrong != other.engine.fingerprint
        assert stats.num_prompt_tokens_computed == 0
        assert answers[-1].HasField("finished")

    asyncio.run(run())
