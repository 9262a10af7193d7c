"""In-process services on real gRPC loopback servers (port 0), for tests that need to vary
configurations cheaply. The multi-process path is covered by tests/integration."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from app.local_cluster import ClusterConfig, LocalCluster
from decode_service.config import DecodeConfig
from decode_service.service import DecodeService
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_layout import KVCacheDtype
from engine.sampling_params import SamplingParams
from native_engine.builder import build_native_engine
from pdserve.common.convert import sampling_to_proto
from pdserve.common.server import ServerConfig, Service, ServiceServer
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prefill_service.config import PrefillConfig
from prefill_service.service import PrefillService

WorkerStub = prefill_pb2_grpc.PrefillWorkerStub | decode_pb2_grpc.DecodeWorkerStub


def engine_config(
    model: Path,
    block_size: int = 16,
    num_blocks: int = 256,
    max_num_batched_tokens: int = 2048,
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    host_cache_gib: float = 0.0,
) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_dtype=kv_cache_dtype,
            host_cache_gib=host_cache_gib,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
    )


async def start(service: Service) -> ServiceServer:
    server = ServiceServer(service, ServerConfig(port=0))
    await server.start()
    await server.ready()
    return server


async def start_prefill(
    model: Path,
    max_num_batched_tokens: int = 2048,
    num_blocks: int = 256,
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    host_cache_gib: float = 0.0,
    **kwargs: object,
) -> tuple[PrefillService, ServiceServer]:
    engine = engine_config(
        model,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_dtype=kv_cache_dtype,
        host_cache_gib=host_cache_gib,
    )
    service = PrefillService(PrefillConfig(engine=engine, **kwargs), build_native_engine)  # type: ignore[arg-type]
    return service, await start(service)


async def start_decode(
    model: Path,
    block_size: int = 16,
    num_blocks: int = 256,
    peers: Sequence[ServiceServer] = (),
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    **kwargs: object,
) -> tuple[DecodeService, ServiceServer]:
    """``peers``: the prefill servers it may pull from (without a registry to learn them)."""
    prefill_peers = tuple(server.service.address for server in peers)
    config = DecodeConfig(
        engine=engine_config(model, block_size, num_blocks, kv_cache_dtype=kv_cache_dtype),
        prefill_peers=prefill_peers,
        **kwargs,  # type: ignore[arg-type]
    )
    service = DecodeService(config, build_native_engine)
    return service, await start(service)


async def wait_for(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, poll_s: float = 0.01
) -> None:
    """Polls ``check`` until true; fails the test after ``timeout_s`` (a bound, not a guess).
    The deadline is also checked between polls: the timeout's one cancel can be swallowed by a
    client library closing a connection, and the loop would then poll for ever."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError
                await asyncio.sleep(poll_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout_s} s") from None


async def all_blocks_free(stub: WorkerStub) -> bool:
    stats = await stub.GetStats(common_pb2.GetStatsRequest())
    return (
        stats.num_free_blocks == stats.num_blocks
        and stats.num_pinned == 0
        and stats.num_running == 0
        and stats.num_waiting == 0
        and stats.num_inflight == 0
    )


async def both_sides_freed(
    prefill_server: ServiceServer, decode_server: ServiceServer, timeout_s: float = 30.0
) -> None:
    """Waits (bounded) until the prefill and the decode worker hold no block or request."""
    decode, prefill = decode_stub(decode_server), prefill_stub(prefill_server)
    await wait_for(lambda: all_blocks_free(decode), timeout_s, "decode blocks freed")
    await wait_for(lambda: all_blocks_free(prefill), timeout_s, "prefill blocks freed")


def prefill_stub(server: Any) -> prefill_pb2_grpc.PrefillWorkerStub:
    return prefill_pb2_grpc.PrefillWorkerStub(grpc.aio.insecure_channel(server.address))


def decode_stub(server: Any) -> decode_pb2_grpc.DecodeWorkerStub:
    return decode_pb2_grpc.DecodeWorkerStub(grpc.aio.insecure_channel(server.address))


async def prefilled_request(
    prefill_server: Any,
    prompt: list[int],
    params: SamplingParams,
    request_id: str = "r",
    prefix: prefill_pb2.PrefixSource | None = None,
) -> decode_pb2.DecodeRequest:
    """Prefills ``prompt`` on ``prefill_server`` (anything with an ``address``: an in-process
    server, a cluster's worker); the ``Decode`` request that continues it, naming the prefill
    worker as its peers know it (an in-process server's advertised address). ``prefix``: where
    the prefill worker may pull the prompt's cached prefix from first."""
    sampling = sampling_to_proto(params)
    prefilled = await prefill_stub(prefill_server).Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, prefix=prefix
        )
    )
    known_as = (
        prefill_server.service.address
        if isinstance(prefill_server, ServiceServer)
        else prefill_server.address
    )
    return decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        first_token_id=prefilled.first_token_id,
        handle=prefilled.lease,
        prefill_address=known_as,
    )


async def disaggregated(
    prefill_server: Any,
    decode_server: Any,
    prompt: list[int],
    params: SamplingParams,
    request_id: str = "r",
    prefix: prefill_pb2.PrefixSource | None = None,
) -> list[int]:
    """One request prefilled on one worker and decoded on the other: the decoded tokens."""
    request = await prefilled_request(prefill_server, prompt, params, request_id, prefix)
    return [t async for r in decode_stub(decode_server).Decode(request) for t in r.tokens.token_ids]


async def failed_decode(
    prefill_server: Any,
    decode_server: Any,
    prompt: list[int],
    params: SamplingParams,
    request_id: str = "r",
) -> grpc.aio.AioRpcError:
    """Prefills ``prompt`` on one worker and decodes its handle on the other, which must fail:
    the decode stream's error (a test of a refused or failed pull)."""
    request = await prefilled_request(prefill_server, prompt, params, request_id)
    try:
        async for _ in decode_stub(decode_server).Decode(request):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the decode stream ended without the error it must end with")


@contextlib.contextmanager
def openai_cluster(
    model: Path, log_dir: Path, served_model_name: str, *router_args: str
) -> Iterator[LocalCluster]:
    """A local cluster with the OpenAI HTTP API on, every prompt prefilled on the prefill
    worker (disaggregated), serving ``model`` as ``served_model_name``."""
    flags = ("--local-prefill-tokens", "0", "--served-model-name", served_model_name)
    config = ClusterConfig(
        model=str(model), router_http_port=0, log_dir=log_dir, router_args=(*flags, *router_args)
    )
    with LocalCluster(config) as cluster:
        yield cluster
