"""A prefill worker's KV sender restarted at the same address (a pod restarted in place, a
supervisor's restart): the decode side's pulls from the old one fail UNAVAILABLE, and its
pulls from the new one work at once, not after gRPC's reconnect backoff (which grows to two
minutes) for the channel that saw the old one die; and a pull from the dead one fails at once,
not at its deadline. Both address-based backends."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvtransfer import KVTransferError, ReceiverOptions, TransferErrorCode, make_receiver
from kvtransfer.wire import handle_from_proto
from native_engine import LLM
from native_engine.llm_engine import LLMEngine
from pdserve.common.channels import ChannelPool
from pdserve.common.server import ServiceServer
from tests.contract.test_kvtransfer_contract import (
    GREEDY,
    _finish,
    _prefill,
    _prefilled,
    _release,
)
from tests.services.harness import engine_config, prefill_stub, start_prefill

TIMEOUT_S = 60.0
PROMPTS = {f"r{i}": [3 + i] * (21 + 9 * i) for i in range(3)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _crash(server: ServiceServer) -> None:
    """Gone at once, holding its leases: no drain (a kill -9 between OS processes is
    tests/nixl/test_nixl_processes.py)."""
    await server.server.stop(grace=None)
    await server.service.close()


@pytest.mark.parametrize("backend", ["grpc", "nixl"])
def test_sender_restarted_at_the_same_address_is_pulled_from_at_once(
    backend: str, llama_dir: Path
) -> None:
    outputs = LLM(str(llama_dir)).generate(list(PROMPTS.values()), GREEDY)
    reference = {rid: out.token_ids for rid, out in zip(PROMPTS, outputs, strict=True)}
    decode = LLMEngine(engine_config(llama_dir))
    kv_port = _free_port()

    async def pull(stub: object, rid: str, receiver: object) -> list[int]:
        response = await _prefill(stub, rid, PROMPTS[rid], GREEDY)
        prefilled = _prefilled(response, PROMPTS[rid])
        block_ids = decode.reserve_prefilled(prefilled)
        assert block_ids is not None
        await receiver.pull(handle_from_proto(response.lease), block_ids)  # type: ignore[attr-defined]
        assert await _release(stub, response)  # as the decode worker does once it has the blocks
        return _finish(decode, prefilled)

    async def run() -> None:
        receiver = make_receiver(backend, decode.kv_cache, ReceiverOptions(timeout_s=TIMEOUT_S))
        try:
            _, old = await start_prefill(llama_dir, kv_backend=backend, kv_port=kv_port)
            assert await pull(prefill_stub(old), "r0", receiver) == reference["r0"]
            # A handle from the old sender, which then goes away: UNAVAILABLE, the caller frees.
            response = await _prefill(prefill_stub(old), "r1", PROMPTS["r1"], GREEDY)
            block_ids = decode.reserve_prefilled(_prefilled(response, PROMPTS["r1"]))
            assert block_ids is not None
            await _crash(old)
            start = time.monotonic()
            with pytest.raises(KVTransferError) as err:
                await receiver.pull(handle_from_proto(response.lease), block_ids)
            assert err.value.code is TransferErrorCode.UNAVAILABLE
            # Known at once (connection refused on a fresh channel), not at the pull's deadline.
            assert time.monotonic() - start < 10.0
            decode.abort("r1")
            # Its successor at the same KV address: the first pull from it works.
            service, new = await start_prefill(llama_dir, kv_backend=backend, kv_port=kv_port)
            try:
                assert service.kv_address.endswith(f":{kv_port}")
                assert await pull(prefill_stub(new), "r2", receiver) == reference["r2"]
            finally:
                await new.shutdown()
            decode.block_manager.check_no_leaks()
        finally:
            await receiver.close()

    asyncio.run(run())


def test_a_retired_channel_is_replaced_and_still_finishes_what_it_carries() -> None:
    async def check(channel: grpc.aio.Channel) -> None:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)

    async def run() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        pool = ChannelPool()
        try:
            first = pool.get(address)
            await check(first)
            pool.reset(address, pool.get("127.0.0.1:1"))  # another address's channel: no-op
            assert pool.get(address) is first
            pool.reset(address, first)
            second = pool.get(address)
            assert second is not first
            pool.reset(address, first)  # a late failure on the retired one: keeps the new one
            assert pool.get(address) is second
            await check(first)  # retired, within its grace: a retry on it still gets through
            await check(second)
            await pool.retain(set())  # its peer left: retired too, stragglers still get through
            assert pool.get(address) is not second
            await check(second)
        finally:
            await pool.close()
            await server.stop(None)
        with pytest.raises(grpc.aio.UsageError):  # closed with the pool
            await check(first)

    asyncio.run(run())
