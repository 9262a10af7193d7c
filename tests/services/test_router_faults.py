"""The router under partial failures, in-process on real gRPC: a failed KV pull is answered by
prefilling again elsewhere (not by offering the spent handle to another decode worker); prompts
no worker can hold are refused before any work; a worker leaving the pool while Redis answers
a prefix lookup is no error."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from app.client import generate
from engine import SamplingParams
from native_engine import LLM
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.registry import WorkerRecord
from pdserve.common.convert import sampling_to_proto
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, prefill_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.policy import RoutingPolicy
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

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_failed_pull_prefills_again_on_another_worker(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompt = list(range(40, 140))
    reference = make_llm(llama_dir).generate([prompt], PARAMS)[0]

    async def run() -> None:
        broken, broken_server = await start_prefill(llama_dir)
        _, good_server = await start_prefill(llama_dir)
        peers = [broken_server, good_server]
        decodes = [await start_decode(llama_dir, peers=peers) for _ in range(2)]
        assert broken._sender is not None
        await broken._sender.stop()  # its KV port is gone: every pull from it fails
        router = await start(
            RouterService(
                RouterConfig(
                    model=str(llama_dir),
                    # The broken worker first: round-robin's first turn lands on index 1.
                    prefill_addresses=(good_server.address, broken_server.address),
                    decode_addresses=tuple(server.address for _, server in decodes),
                    prefill_policy=RoutingPolicy.ROUND_ROBIN,
                    local_prefill_tokens=0,
                )
            )
        )
        transfer_before = _count("pdserve_migrations_total", reason="transfer")
        not_found_before = _count("pdserve_kv_transfer_failures_total", reason="not_found")
        try:
            async with grpc.aio.insecure_channel(router.address) as channel:
                request = router_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS)
                )
                result = await generate(router_pb2_grpc.RouterStub(channel), request)
            assert result.token_ids == reference.token_ids
            assert _count("pdserve_migrations_total", reason="transfer") == transfer_before + 1
            # The spent handle was never offered to the other decode worker.
            assert (
                _count("pdserve_kv_transfer_failures_total", reason="not_found") == not_found_before
            )
            for server in (broken_server, good_server, *(s for _, s in decodes)):
                stub = (
                    prefill_stub(server)
                    if server in (broken_server, good_server)
                    else decode_stub(server)
                )
                await wait_for(lambda s=stub: all_blocks_free(s), 30.0, "blocks freed")
        finally:
            await router.shutdown()
            for _, server in decodes:
                await server.shutdown()
            await good_server.shutdown()
            await broken_server.shutdown()

    asyncio.run(run())


def test_a_prompt_no_prefill_worker_can_hold_is_refused_before_any_work(llama_dir: Path) -> None:
    async def run() -> None:
        _, prefill_server = await start_prefill(llama_dir, num_blocks=4)  # 64 tokens
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        router = await start(
            RouterService(
                RouterConfig(
                    model=str(llama_dir),
                    prefill_addresses=(prefill_server.address,),
                    decode_addresses=(decode_server.address,),
                    local_prefill_tokens=0,
                )
            )
        )
        try:
            # Straight to the worker: refused by name, not an assertion (UNKNOWN).
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await prefill_stub(prefill_server).Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="big",
                        prompt_token_ids=list(range(1, 200)),
                        sampling=sampling_to_proto(PARAMS),
                    )
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "needs 13 KV blocks" in (err.value.details() or "")
            # Through the router: refused before the prefill worker computes anything.
            async with grpc.aio.insecure_channel(router.address) as channel:
                request = router_pb2.GenerateRequest(
                    prompt_token_ids=list(range(1, 200)), sampling=sampling_to_proto(PARAMS)
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(router_pb2_grpc.RouterStub(channel), request)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "no prefill worker can hold 199 prompt tokens" in (err.value.details() or "")
            stats = await prefill_stub(prefill_server).GetStats(common_pb2.GetStatsRequest())
            assert stats.num_prompt_tokens_computed == 0
        finally:
            await router.shutdown()
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())


def test_a_prompt_only_the_larger_prefill_worker_holds_goes_to_it(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """Uneven prefill caches: round robin would hand every other request to the small worker,
    which can never hold these prompts; each goes to the large one (before: RESOURCE_EXHAUSTED
    to the client for half of them)."""
    prompts = [list(range(10 + i, 110 + i)) for i in range(4)]  # 100 tokens: 7 blocks
    reference = make_llm(llama_dir).generate(prompts, PARAMS)

    async def run() -> None:
        _, small_server = await start_prefill(llama_dir, num_blocks=4)  # 64 tokens
        _, large_server = await start_prefill(llama_dir, num_blocks=64)
        peers = [small_server, large_server]
        _, decode_server = await start_decode(llama_dir, peers=peers)
        router = await start(
            RouterService(
                RouterConfig(
                    model=str(llama_dir),
                    prefill_addresses=(small_server.address, large_server.address),
                    decode_addresses=(decode_server.address,),
                    prefill_policy=RoutingPolicy.ROUND_ROBIN,
                    local_prefill_tokens=0,
                )
            )
        )
        try:
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                results = [
                    await generate(
                        stub,
                        router_pb2.GenerateRequest(
                            prompt_token_ids=p, sampling=sampling_to_proto(PARAMS)
                        ),
                    )
                    for p in prompts
                ]
            small = await prefill_stub(small_server).GetStats(common_pb2.GetStatsRequest())
        finally:
            await router.shutdown()
            await decode_server.shutdown()
            await large_server.shutdown()
            await small_server.shutdown()
        assert [r.token_ids for r in results] == [e.token_ids for e in reference]
        assert small.num_prompt_tokens_computed == 0

    asyncio.run(run())


def test_workers_leaving_during_prefix_lookups_are_no_error(
    llama_dir: Path, redis_url: str
) -> None:
    """Cache-aware choices await Redis; the pool may drop a worker meanwhile. The choice uses
    the workers it looked up, never a second lookup by address (a KeyError before)."""

    async def run() -> None:
        redis = RedisConfig(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
        _, decode_server = await start_decode(llama_dir, redis=redis)
        _, prefill_server = await start_prefill(llama_dir, redis=redis)
        service = RouterService(RouterConfig(model=str(llama_dir), redis=redis))
        router = await start(service)
        fp, pool = service.dispatch.cluster.fingerprint, service.pool
        records = [
            WorkerRecord(f"p{i}", Role.PREFILL, f"127.0.0.1:{40000 + i}", fp, 16, 64)
            for i in range(8)
        ]
        rng = random.Random(3)
        stop = asyncio.Event()

        async def churn() -> None:
            while not stop.is_set():
                pool.sync(records, fp, 16)
                for address in rng.sample(sorted(pool.prefill), 4):
                    # Gone from the pool while still looking healthy to an earlier snapshot.
                    pool.prefill.pop(address)
                await asyncio.sleep(0)

        churner = asyncio.create_task(churn())
        try:
            for _ in range(200):
                placement = await service.dispatch.place(list(range(64)))
                assert all(w.role is Role.PREFILL for w in placement.prefill)
        finally:
            stop.set()
            await churner
            await router.shutdown()
            await prefill_server.shutdown()
            await decode_server.shutdown()

    asyncio.run(run())
