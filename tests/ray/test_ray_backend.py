"""Ray object store backend, beyond the shared contract: Ray's object accounting sees our
objects and their end, a damaged payload is caught, and staged objects live exactly as long as
their lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import ray

from app.ray_deploy.objects import live_objects
from kvstore_service.config import KVStoreConfig
from kvstore_service.service import KVStoreService
from kvtransfer import KVHandle, KVReceiver, ReceiverOptions, make_receiver
from kvtransfer.lease_manager import LeaseManager
from kvtransfer.ray_mailbox import LayerRange
from kvtransfer.ray_object_store import Payload, RayKVSender
from kvtransfer.wire import handle_from_proto
from native_engine import LLM
from native_engine.llm_engine import LLMEngine
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.contract.test_kvtransfer_contract import GREEDY, _prefilled
from tests.ray_util import no_new_objects
from tests.services.harness import (
    both_sides_freed,
    disaggregated,
    engine_config,
    failed_decode,
    prefill_stub,
    start,
    start_decode,
    start_prefill,
    wait_for,
)
from tests.services.test_kv_store import PROMPTS as STORE_PROMPTS
from tests.services.test_kv_store import PULLABLE, host_gib, offload_first_prompt
from tests.services.test_transfer_failures import PARAMS, PROMPT


@pytest.fixture(autouse=True)
def _ray(ray_address: str) -> Iterator[None]:
    with no_new_objects():
        yield


def test_object_accounting_sees_an_object_until_it_is_freed() -> None:
    before = {o.object_id for o in live_objects()}
    ref = ray.put(np.zeros(1 << 20, dtype=np.uint8))
    new = [o for o in live_objects() if o.object_id not in before]
    assert [o.object_id for o in new] == [ref.hex()]
    assert new[0].size_bytes >= 1 << 20
    del ref  # no_new_objects (autouse) now requires Ray to free it


def test_damaged_payload_is_data_loss_and_frees_both_sides(llama_dir: Path) -> None:
    async def run() -> None:
        prefill, prefill_server = await start_prefill(llama_dir, kv_backend="ray")
        _, decode_server = await start_decode(llama_dir, kv_backend="ray", peers=[prefill_server])
        sender = prefill._sender
        assert isinstance(sender, RayKVSender)
        stage = sender._stage

        def damaged(block_ids: list[int], layers: LayerRange) -> tuple[Payload, tuple[int, ...]]:
            # A faulty store: one bit flips after the digests were taken.
            payload, digests = stage(block_ids, layers)
            payload = payload.copy()
            payload[-1, payload.shape[1] // 2] ^= 0x10
            return payload, digests

        sender._stage = damaged  # type: ignore[method-assign]
        try:
            error = await failed_decode(prefill_server, decode_server, PROMPT, PARAMS)
            assert error.code() == grpc.StatusCode.DATA_LOSS
            assert "digest mismatch in layer 1" in (error.details() or "")
            await both_sides_freed(prefill_server, decode_server)
            assert sender.num_staged == 0  # the release ended the lease and dropped the object
        finally:
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())


@dataclass
class _Pulled:
    """A request prefilled on a Ray-backed prefill service, with decode blocks reserved."""

    sender: RayKVSender
    stub: prefill_pb2_grpc.PrefillWorkerStub
    receiver: KVReceiver
    handle: KVHandle
    block_ids: list[int]
    decode: LLMEngine
    leases: LeaseManager

    @property
    def num_bytes(self) -> int:
        return self.handle.num_blocks * self.decode.kv_layout.block_bytes

    async def release(self) -> bool:
        token = self.handle.lease_token
        reply = await self.stub.Release(
            prefill_pb2.ReleaseRequest(request_id="r", lease_token=token)
        )
        return bool(reply.released)


@asynccontextmanager
async def _prefilled_on_ray(llama_dir: Path) -> AsyncIterator[_Pulled]:
    decode = LLMEngine(engine_config(llama_dir))
    # A lease that cannot expire within the test, however loaded the machine: these tests end
    # it themselves (Release), and expiry has its own contract test.
    prefill, server = await start_prefill(llama_dir, kv_backend="ray", lease_s=3600.0)
    stub = prefill_stub(server)
    receiver = make_receiver("ray", decode.kv_cache, ReceiverOptions(timeout_s=30))
    sender = prefill._sender
    assert isinstance(sender, RayKVSender)
    try:
        response = await stub.Prefill(
            prefill_pb2.PrefillRequest(
                request_id="r", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY)
            )
        )
        block_ids = decode.reserve_prefilled(_prefilled(response, PROMPT))
        assert block_ids is not None
        handle = handle_from_proto(response.lease)
        yield _Pulled(sender, stub, receiver, handle, block_ids, decode, prefill.leases)
        decode.abort("r")
        decode.block_manager.check_no_leaks()
    finally:
        await receiver.close()
        await server.shutdown()


def test_staged_object_lives_until_the_lease_ends(llama_dir: Path) -> None:
    """The sender owns the object from the first pull to the release; a second pull of the
    same lease reuses it."""

    def stored() -> set[str]:  # objects with data (pending call results have none)
        return {o.object_id for o in live_objects() if o.size_bytes >= 0}

    async def run() -> None:
        async with _prefilled_on_ray(llama_dir) as p:
            before = stored()
            first = await p.receiver.pull(p.handle, p.block_ids)
            # The sender holds one new object, and Ray's store has it. (The store's listing may
            # also show the pull's own call result for a moment on a loaded box.)
            held = p.sender.staged_object_ids
            assert len(held) == 1 and held <= stored() - before
            await p.receiver.pull(p.handle, p.block_ids)  # a retry: same object, no second put
            assert p.sender.staged_object_ids == held and held <= stored()
            assert first.num_bytes == p.num_bytes
            assert await p.release()
            assert p.sender.staged_object_ids == frozenset()

    asyncio.run(run())


def test_a_release_cancelled_mid_free_still_ends_the_lease_at_the_sender(
    llama_dir: Path,
) -> None:
    """A Release whose caller goes away while the blocks are being freed: the table forgot the
    lease already, so the free runs on to the sender's ``lease_ended`` (its staged object goes);
    before, the cancellation skipped it and the object stayed in the store for good."""

    async def run() -> None:
        async with _prefilled_on_ray(llama_dir) as p:
            await p.receiver.pull(p.handle, p.block_ids)
            assert p.sender.num_staged == 1
            leases = p.leases
            ending = asyncio.create_task(leases.end("r", p.handle.lease_token))
            while len(leases) > 0:  # until the table forgot it: the free has begun
                await asyncio.sleep(0)
            ending.cancel()
            await asyncio.gather(ending, return_exceptions=True)
            await wait_for(_staged_none(p.sender), 30.0, "the sender dropped the object")

    asyncio.run(run())


def _staged_none(sender: RayKVSender) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return sender.num_staged == 0

    return check


def test_a_lost_mailbox_is_replaced_under_the_same_name(llama_dir: Path) -> None:
    """Ray kills the mailbox (say, for memory): the sender starts a new one under the same
    name, so handles already issued keep working."""

    async def run() -> None:
        async with _prefilled_on_ray(llama_dir) as p:
            old = p.sender._mailbox
            ray.kill(old)

            async def replaced() -> bool:
                return p.sender._mailbox is not old

            await wait_for(replaced, 30.0, "a new mailbox", poll_s=0.05)
            stats = await p.receiver.pull(p.handle, p.block_ids)  # a handle from before
            assert stats.num_bytes == p.num_bytes
            assert await p.release()

    asyncio.run(run())


def test_a_prefix_offloaded_to_a_store_is_pulled_back_over_ray(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """docs/kv-cache.md, "The store": with the Ray backend, the store's sender stages its
    leased blocks in the object store; a fresh worker pulls them and computes only the rest,
    and the release drops the staged object (``no_new_objects``)."""
    want = make_llm(llama_dir).generate([STORE_PROMPTS[0]], GREEDY)[0].token_ids

    async def run() -> None:
        capacity = host_gib(llama_dir, 256)
        config = KVStoreConfig(model=str(llama_dir), capacity_gib=capacity, kv_backend="ray")
        store = await start(KVStoreService(config))
        stores = (store.service.address,)
        _, writer = await start_prefill(
            llama_dir,
            num_blocks=24,
            host_cache_gib=host_gib(llama_dir, 20),
            kv_backend="ray",
            kv_stores=stores,
        )
        _, fresh = await start_prefill(llama_dir, kv_backend="ray", kv_stores=stores)
        peers = [writer, fresh]
        _, decode = await start_decode(llama_dir, kv_backend="ray", peers=peers)
        try:
            await offload_first_prompt(writer, decode, [store], GREEDY)
            source = prefill_pb2.PrefixSource(
                holder_address=store.service.address, num_blocks=PULLABLE
            )
            tokens = await disaggregated(fresh, decode, STORE_PROMPTS[0], GREEDY, "r", source)
            assert tokens == want[1:]
            stats = await prefill_stub(fresh).GetStats(common_pb2.GetStatsRequest())
            assert stats.num_prompt_tokens_computed == len(STORE_PROMPTS[0]) - PULLABLE * 16
            await both_sides_freed(fresh, decode)
            sender = store.service._sender
            assert isinstance(sender, RayKVSender)
            await wait_for(_staged_none(sender), 30.0, "the store's staged object dropped")
        finally:
            for server in (fresh, decode, writer, store):
                await server.shutdown()

    asyncio.run(run())
