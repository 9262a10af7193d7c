"""The KV store through the real services (docs/kv-cache.md, "The store"): a prefill worker's
host tier offloads what it evicts to the store; a fresh prefill worker pulls a prompt's prefix
back from it, computes only the rest and decodes what one engine does; a store that is gone,
or holds nothing, costs a recompute; a prefix written to two stores survives one of them."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from app.client import generate
from engine import SamplingParams
from engine.block_hash import hash_blocks, root_hash
from engine.kv_layout import KVCacheDtype
from engine.model_layout import ModelLayout
from kvstore_service.config import KVStoreConfig
from kvstore_service.service import KVStoreService, store_layout
from native_engine import LLM
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.prefix_index import ANY_TIER
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.common import metrics
from pdserve.common.convert import layout_to_proto, sampling_to_proto
from pdserve.common.server import ServiceServer
from pdserve.v1 import (
    common_pb2,
    kv_store_pb2,
    kv_store_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from router.config import RouterConfig
from router.policy import RoutingPolicy
from router.service import RouterService
from tests.services.harness import (
    both_sides_freed,
    decode_stub,
    disaggregated,
    prefill_stub,
    prefilled_request,
    start,
    start_decode,
    start_prefill,
    wait_for,
)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
PROMPTS = [[(7 * k + i) % 1000 + 3 for i in range(297)] for k in range(3)]  # 18 blocks + 9
PULLABLE = 18  # whole blocks of 16 before each prompt's last token


FULL = KVCacheDtype.AUTO


def host_gib(model: Path, num_blocks: int, kv: KVCacheDtype = FULL) -> float:
    config = KVStoreConfig(model=str(model), layout=ModelLayout(kv_cache_dtype=kv))
    return num_blocks * store_layout(config).block_bytes / 2**30


async def start_store(
    model: Path, capacity_blocks: int = 256, kv: KVCacheDtype = FULL
) -> ServiceServer:
    capacity = host_gib(model, capacity_blocks, kv)
    layout = ModelLayout(kv_cache_dtype=kv)
    config = KVStoreConfig(model=str(model), layout=layout, capacity_gib=capacity)
    return await start(KVStoreService(config))


async def start_offloading(
    model: Path, stores: list[ServiceServer], replicas: int = 1, kv: KVCacheDtype = FULL
) -> object:
    """A prefill worker whose caches hold little (24 device blocks, 20 host-tier blocks):
    a prompt of 18 blocks pushes the one before it out of the host tier, to the stores."""
    _, server = await start_prefill(
        model,
        num_blocks=24,
        host_cache_gib=host_gib(model, 20, kv),
        kv_cache_dtype=kv,
        kv_stores=tuple(s.service.address for s in stores),
        kv_store_replicas=replicas,
    )
    return server


async def shut(servers: list[Any]) -> None:
    """Shuts down every server still serving (a test may have stopped a store already)."""
    for server in servers:
        if server.service.serving:
            await server.shutdown()


async def stop(server: ServiceServer) -> None:
    await shut([server])


async def held(store: ServiceServer) -> int:
    stats = await prefill_stub(store).GetStats(common_pb2.GetStatsRequest())
    return int(stats.num_cached_blocks)


async def computed(server: object) -> int:
    stats = await prefill_stub(server).GetStats(common_pb2.GetStatsRequest())
    return int(stats.num_prompt_tokens_computed)


async def offload_first_prompt(
    writer: object, decode: ServiceServer, stores: list[ServiceServer], params: SamplingParams
) -> None:
    """Runs every prompt on ``writer``; the first one's blocks end up in the stores."""
    for i, prompt in enumerate(PROMPTS):
        await disaggregated(writer, decode, prompt, params, f"w{i}")
    for store in stores:
        await wait_for(lambda s=store: _holds(s), 30.0, "the first prompt offloaded")


async def _holds(store: ServiceServer) -> bool:
    return await held(store) >= PULLABLE


@pytest.mark.parametrize(
    ("params", "kv"),
    [(PARAMS, FULL), (SEEDED, FULL), (PARAMS, KVCacheDtype.INT8)],
    ids=["greedy", "seeded", "greedy-int8"],
)
def test_evicted_blocks_land_in_the_store_and_a_fresh_worker_pulls_them(
    llama_dir: Path, make_llm: Callable[..., LLM], params: SamplingParams, kv: KVCacheDtype
) -> None:
    """Quantized too: the bytes pulled are the codes and scales the writer computed, so the
    output is one int8 engine's."""
    want = make_llm(llama_dir, kv_cache_dtype=kv.value).generate([PROMPTS[0]], params)[0]
    want = want.token_ids

    async def run() -> None:
        store = await start_store(llama_dir, kv=kv)
        writer = await start_offloading(llama_dir, [store], kv=kv)
        stores = (store.service.address,)
        _, fresh = await start_prefill(llama_dir, kv_cache_dtype=kv, kv_stores=stores)
        peers = [writer, fresh]
        _, d_server = await start_decode(llama_dir, peers=peers, kv_cache_dtype=kv)  # type: ignore[arg-type]
        try:
            await offload_first_prompt(writer, d_server, [store], params)
            source = prefill_pb2.PrefixSource(
                holder_address=store.service.address, num_blocks=PULLABLE
            )
            request = await prefilled_request(fresh, PROMPTS[0], params, "fresh", source)
            assert request.first_token_id == want[0]
            assert await computed(fresh) == len(PROMPTS[0]) - PULLABLE * 16  # the rest only
            tokens = [
                t async for r in decode_stub(d_server).Decode(request) for t in r.tokens.token_ids
            ]
            assert tokens == want[1:]
            await both_sides_freed(fresh, d_server)
            stats = await prefill_stub(store).GetStats(common_pb2.GetStatsRequest())
            await wait_for(lambda: _no_leases(store), 30.0, "the store's lease released")
            assert stats.num_blocks == 256
        finally:
            await shut([fresh, d_server, writer, store])

    asyncio.run(run())


async def _no_leases(store: ServiceServer) -> bool:
    stats = await prefill_stub(store).GetStats(common_pb2.GetStatsRequest())
    return stats.num_pinned == 0 and stats.num_inflight == 0


def test_a_store_that_is_gone_or_holds_nothing_costs_a_recompute(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    want, other = (
        o.token_ids for o in make_llm(llama_dir).generate([PROMPTS[1], PROMPTS[2]], PARAMS)
    )

    async def run() -> None:
        store = await start_store(llama_dir)
        _, fresh = await start_prefill(llama_dir, kv_stores=(store.service.address,))
        _, d_server = await start_decode(llama_dir, peers=[fresh])
        address = store.service.address
        source = prefill_pb2.PrefixSource(holder_address=address, num_blocks=PULLABLE)
        try:
            # The store holds nothing of the prompt: its answer has no lease.
            empty = failures("not_cached")
            tokens = await disaggregated(fresh, d_server, PROMPTS[1], PARAMS, "empty", source)
            assert tokens == want[1:] and failures("not_cached") == empty + 1
            assert await computed(fresh) == len(PROMPTS[1])
            # The store is gone: the worker computes what its own cache lacks (none of it now).
            await stop(store)
            gone = failures("holder_unavailable")
            tokens = await disaggregated(fresh, d_server, PROMPTS[2], PARAMS, "gone", source)
            assert tokens == other[1:] and failures("holder_unavailable") == gone + 1
            assert await computed(fresh) == len(PROMPTS[1]) + len(PROMPTS[2])
            await both_sides_freed(fresh, d_server)
        finally:
            await shut([fresh, d_server, store])

    asyncio.run(run())


def failures(reason: str) -> float:
    return float(metrics.PEER_PULL_FAILURES.labels(reason)._value.get())


def test_a_prefix_written_to_two_stores_survives_one(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    want = make_llm(llama_dir).generate([PROMPTS[0]], PARAMS)[0].token_ids

    async def run() -> None:
        stores = [await start_store(llama_dir), await start_store(llama_dir)]
        writer = await start_offloading(llama_dir, stores, replicas=2)
        survivor = stores[1]
        _, fresh = await start_prefill(
            llama_dir, kv_stores=tuple(s.service.address for s in stores)
        )
        _, d_server = await start_decode(llama_dir, peers=[writer, fresh])  # type: ignore[list-item]
        try:
            await offload_first_prompt(writer, d_server, stores, PARAMS)
            await stop(stores[0])
            source = prefill_pb2.PrefixSource(
                holder_address=survivor.service.address, num_blocks=PULLABLE
            )
            tokens = await disaggregated(fresh, d_server, PROMPTS[0], PARAMS, "r", source)
            assert tokens == want[1:]
            assert await computed(fresh) == len(PROMPTS[0]) - PULLABLE * 16
            await both_sides_freed(fresh, d_server)
        finally:
            await shut([fresh, d_server, writer, *stores])

    asyncio.run(run())


def test_the_plan_pulls_a_prefix_from_the_store_the_index_names(
    llama_dir: Path, redis_url: str, make_llm: Callable[..., LLM]
) -> None:
    """End to end with the registry and the prefix index: the store registers, publishes what
    it holds, and the router's cost policy plans the pull from it (reason "store")."""
    want = make_llm(llama_dir).generate([PROMPTS[0]], PARAMS)[0].token_ids

    async def run() -> None:
        redis = RedisConfig(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
        capacity = host_gib(llama_dir, 256)
        store_config = KVStoreConfig(model=str(llama_dir), capacity_gib=capacity, redis=redis)
        store = await start(KVStoreService(store_config))
        _, writer = await start_prefill(
            llama_dir, num_blocks=24, host_cache_gib=host_gib(llama_dir, 20), redis=redis
        )
        _, fresh = await start_prefill(llama_dir, redis=redis)
        _, d_server = await start_decode(llama_dir, redis=redis)
        config = RouterConfig(
            model=str(llama_dir),
            redis=redis,
            prefill_policy=RoutingPolicy.COST,
            local_prefill_tokens=0,
        )
        router = await start(RouterService(config))
        index = RedisPrefixIndex.from_url(redis_url, redis.namespace)
        servers = [router, fresh, d_server, writer, store]
        try:
            offloader = writer.service.offloader

            async def knows_the_store() -> bool:
                # Found in the registry, not named: what the writer evicts before it knows
                # the store is dropped (it only saves a recompute), and this test needs it.
                return offloader is not None and offloader.wanted()

            await wait_for(knows_the_store, 30.0, "the writer knows the store")
            await offload_first_prompt(writer, d_server, [store], PARAMS)
            layout = store_layout(store_config)
            keys = hash_blocks(root_hash(layout.model_fingerprint), PROMPTS[0][:288], 16)
            store_id = store.service.worker_id

            writer_id = writer.service.worker_id

            async def indexed() -> bool:
                # The store's blocks are published, and the writer's evictions too (else the
                # router, rightly, sends the prompt to the writer's host tier it believes in).
                stored = await index.longest_prefixes(keys, [store_id])
                left = await index.longest_prefixes(keys, [writer_id], ANY_TIER)
                return stored[store_id] == PULLABLE and left[writer_id] == 0

            await wait_for(indexed, 30.0, "the index shows the prefix in the store alone")
            pool = router.service.pool

            async def priced() -> bool:  # the router knows the store and its layout
                return any(w.routable and w.kv_layout for w in pool.stores.values())

            await wait_for(priced, 30.0, "the router knows the store")
            before = await computed(writer) + await computed(fresh)
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                request = router_pb2.GenerateRequest(
                    prompt_token_ids=PROMPTS[0], sampling=sampling_to_proto(PARAMS)
                )
                result = await generate(stub, request)
            assert result.token_ids == want
            # One of the two pulled the store's 18 blocks and computed the rest.
            assert await computed(writer) + await computed(fresh) == before + 9
            decisions = metrics.ROUTING_DECISIONS.labels("prefill", "cost", "store")
            assert decisions._value.get() >= 1
            await both_sides_freed(fresh, d_server)
            await both_sides_freed(writer, d_server)
        finally:
            await index.close()
            await shut(servers)

    asyncio.run(run())


def test_bad_offloads_and_leases_are_refused_by_name_and_store_nothing(llama_dir: Path) -> None:
    async def run() -> None:
        store = await start_store(llama_dir, capacity_blocks=8)
        layout = store_layout(KVStoreConfig(model=str(llama_dir)))
        channel = grpc.aio.insecure_channel(store.service.address)
        stub = kv_store_pb2_grpc.KVStoreStub(channel)
        data = bytes(layout.block_bytes)
        good = kv_store_pb2.OffloadedBlock(
            block_hash=b"\x01" * 16, data=data, crc32=zlib.crc32(data)
        )

        async def refused(request: kv_store_pb2.OffloadRequest) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Offload(request)
            return caught.value.code(), str(caught.value.details())

        try:
            right = layout_to_proto(layout)
            other = layout_to_proto(dataclasses.replace(layout, num_layers=layout.num_layers + 1))
            code, text = await refused(kv_store_pb2.OffloadRequest(layout=other, blocks=[good]))
            assert code is grpc.StatusCode.FAILED_PRECONDITION and "layout" in text
            short = kv_store_pb2.OffloadedBlock(block_hash=b"\x02" * 8, data=data, crc32=good.crc32)
            code, text = await refused(
                kv_store_pb2.OffloadRequest(layout=right, blocks=[good, short])
            )
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "blocks[1].block_hash" in text
            bad_crc = kv_store_pb2.OffloadedBlock(block_hash=b"\x03" * 16, data=data, crc32=7)
            code, text = await refused(kv_store_pb2.OffloadRequest(layout=right, blocks=[bad_crc]))
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "blocks[0].crc32" in text
            cut = kv_store_pb2.OffloadedBlock(block_hash=b"\x04" * 16, data=data[:-4])
            code, text = await refused(kv_store_pb2.OffloadRequest(layout=right, blocks=[cut]))
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "blocks[0].data" in text
            many = kv_store_pb2.OffloadRequest(layout=right, blocks=[good] * 257)
            code, text = await refused(many)
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in text
            assert await held(store) == 0  # not even the good block of a refused call
            reply = await stub.Offload(kv_store_pb2.OffloadRequest(layout=right, blocks=[good]))
            assert (reply.num_stored, reply.num_held, reply.num_refused) == (1, 0, 0)
            lease = prefill_pb2_grpc.PrefillWorkerStub(channel).LeasePrefix
            for ids, first, named in (
                (list(range(20)), 0, "whole blocks"),
                (list(range(32)), 2, "first_block"),
            ):
                request = prefill_pb2.LeasePrefixRequest(prompt_token_ids=ids, first_block=first)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await lease(request)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert named in str(caught.value.details())
        finally:
            await channel.close()
            await shut([store])

    asyncio.run(run())
