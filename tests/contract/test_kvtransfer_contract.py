"""The contract every KV transfer backend must pass (kvtransfer.base). The Ray backend joins
the parametrization when it exists.

The sender side is the real prefill service (its leases and sender) on a loopback gRPC server;
the receiver writes into a real decode engine's cache. The Ray backend runs on the session's
local Ray, and every Ray test ends with no object of its own left in the cluster.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import PrefilledRequest, SamplingParams
from engine.kv_layout import KVCacheDtype
from engine.outputs import RequestOutput
from kvtransfer import (
    BACKENDS,
    KVHandle,
    KVTransferError,
    ReceiverOptions,
    TransferErrorCode,
    make_receiver,
)
from kvtransfer.wire import handle_from_proto
from native_engine import LLM
from native_engine.llm_engine import LLMEngine
from pdserve.common import tracing
from pdserve.common.convert import sampling_to_proto
from pdserve.common.tracing import TracingConfig
from pdserve.v1 import prefill_pb2
from prefill_service.service import PrefillService
from tests.ray_util import no_new_objects
from tests.services.harness import (
    all_blocks_free,
    engine_config,
    prefill_stub,
    start_prefill,
    wait_for,
)
from tests.services.otlp_receiver import OtlpReceiver

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(params=BACKENDS)  # every registered backend (kvtransfer.REGISTRY)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param != "ray":
        yield request.param
        return
    request.getfixturevalue("ray_address")
    with no_new_objects():
        yield request.param


async def _prefill(
    stub: object, request_id: str, prompt: list[int], params: SamplingParams
) -> prefill_pb2.PrefillResponse:
    request = prefill_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params)
    )
    return await stub.Prefill(request)  # type: ignore[attr-defined, no-any-return]


async def _release(stub: Any, response: prefill_pb2.PrefillResponse) -> bool:
    """Ends the lease as its owner does: with the token its handle carries."""
    request = prefill_pb2.ReleaseRequest(
        request_id=response.request_id, lease_token=response.lease.lease_token
    )
    return bool((await stub.Release(request)).released)


def _prefilled(response: prefill_pb2.PrefillResponse, prompt: list[int]) -> PrefilledRequest:
    return PrefilledRequest(response.request_id, prompt, response.first_token_id, GREEDY, [])


def _source_blocks(service: PrefillService, request_id: str) -> list[int]:
    return service.engine.export_prefilled(request_id).block_ids


def _finish(engine: LLMEngine, prefilled: PrefilledRequest) -> list[int]:
    out = RequestOutput(prefilled.request_id, prefilled.prompt_token_ids)
    first = engine.start_prefilled(prefilled)
    assert first is not None
    out.apply(first)
    while not out.finish_reason:
        for update in engine.step():
            out.apply(update)
    return out.token_ids


@pytest.mark.parametrize("kv_cache_dtype", [KVCacheDtype.AUTO, KVCacheDtype.INT8])
def test_transfer_is_lossless_and_decodes_like_one_engine(
    backend: str, kv_cache_dtype: KVCacheDtype, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """Quantized (int8) too: the codes and their scales arrive bit for bit, and the decode
    worker continues exactly as one int8 engine does."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in (1, 16, 17, 45)]
    reference = make_llm(llama_dir, kv_cache_dtype=kv_cache_dtype.value).generate(prompts, GREEDY)
    decode = LLMEngine(engine_config(llama_dir, kv_cache_dtype=kv_cache_dtype))
    assert decode.kv_layout.kv_cache_dtype is kv_cache_dtype

    async def run() -> None:
        service, server = await start_prefill(
            llama_dir, kv_backend=backend, kv_cache_dtype=kv_cache_dtype
        )
        stub = prefill_stub(server)
        receiver = make_receiver(backend, decode.kv_cache, ReceiverOptions(timeout_s=30))
        try:
            for i, (prompt, expected) in enumerate(zip(prompts, reference, strict=True)):
                response = await _prefill(stub, f"r{i}", prompt, GREEDY)
                handle = handle_from_proto(response.lease)
                assert handle.backend == backend
                prefilled = _prefilled(response, prompt)
                block_ids = decode.reserve_prefilled(prefilled)
                assert block_ids is not None
                stats = await receiver.pull(handle, block_ids)
                source = _source_blocks(service, f"r{i}")
                for layer in range(decode.kv_layout.num_layers):
                    sent = service.engine.kv_cache.read_layer(layer, source)
                    assert torch.equal(decode.kv_cache.read_layer(layer, block_ids), sent)
                assert stats.num_bytes == len(block_ids) * decode.kv_layout.block_bytes
                assert await _release(stub, response)
                assert _finish(decode, prefilled) == expected.token_ids
            # Released leases free at once, except where a sender still reads the blocks
            # (NIXL records the digest in a thread as the handle is issued): bounded.
            await wait_for(lambda: all_blocks_free(stub), 30, "prefill blocks freed")
            decode.block_manager.check_no_leaks()
        finally:
            await receiver.close()
            await server.shutdown()

    asyncio.run(run())


# (how the decode worker's cache differs from the sender's, what the refusal must name): an
# int8 decode worker never accepts a full-precision sender's blocks, nor the reverse.
MISMATCHES = [
    ({"block_size": 8}, ("bs16", "bs8", "block_size 8 != 16|block_size 16 != 8")),
    (
        {"kv_cache_dtype": KVCacheDtype.INT8},
        ("kv-int8", "kv_cache_dtype int8 != auto|kv_cache_dtype auto != int8"),
    ),
]


@pytest.mark.parametrize(("differs", "named"), MISMATCHES, ids=["block_size", "kv_cache_dtype"])
def test_layout_mismatch_names_both_layouts(
    backend: str, differs: dict[str, Any], named: tuple[str, ...], llama_dir: Path
) -> None:
    decode = LLMEngine(engine_config(llama_dir, **differs))

    async def run() -> None:
        _, server = await start_prefill(llama_dir, kv_backend=backend)
        stub = prefill_stub(server)
        receiver = make_receiver(backend, decode.kv_cache, ReceiverOptions(timeout_s=30))
        try:
            response = await _prefill(stub, "r", list(range(1, 40)), GREEDY)
            handle = handle_from_proto(response.lease)
            with pytest.raises(KVTransferError) as err:
                await receiver.pull(handle, list(range(handle.num_blocks)))
            assert err.value.code is TransferErrorCode.LAYOUT_MISMATCH
            for name in named:  # a|b: either side may be the one that refuses
                assert any(n in str(err.value) for n in name.split("|")), (name, err.value)
            assert await _release(stub, response)
            await wait_for(lambda: all_blocks_free(stub), 30, "prefill blocks freed")
            decode.block_manager.check_no_leaks()
        finally:
            await receiver.close()
            await server.shutdown()

    asyncio.run(run())


def test_expired_lease_frees_blocks_and_pull_is_not_found(backend: str, llama_dir: Path) -> None:
    decode = LLMEngine(engine_config(llama_dir))

    async def run() -> None:
        service, server = await start_prefill(llama_dir, kv_backend=backend, lease_s=0.2)
        stub = prefill_stub(server)
        receiver = make_receiver(backend, decode.kv_cache, ReceiverOptions(timeout_s=30))
        try:
            response = await _prefill(stub, "r", list(range(1, 40)), GREEDY)
            assert response.lease.lease_s == pytest.approx(0.2)
            assert len(service.leases) == 1
            # Nobody pulls: the lease, not a decode worker, frees the blocks.
            await wait_for(lambda: all_blocks_free(stub), 30.0, "blocks freed by lease expiry")
            handle = handle_from_proto(response.lease)
            prefilled = _prefilled(response, list(range(1, 40)))
            block_ids = decode.reserve_prefilled(prefilled)
            assert block_ids is not None
            with pytest.raises(KVTransferError) as err:
                await receiver.pull(handle, block_ids)
            assert err.value.code is TransferErrorCode.NOT_FOUND
            decode.abort("r")  # the caller frees what it allocated
            decode.block_manager.check_no_leaks()
        finally:
            await receiver.close()
            await server.shutdown()

    asyncio.run(run())


def test_cancelled_pull_stops_writing_and_leaks_nothing(backend: str, llama_dir: Path) -> None:
    decode = LLMEngine(engine_config(llama_dir))

    async def run() -> None:
        _, server = await start_prefill(llama_dir, kv_backend=backend)
        stub = prefill_stub(server)
        receiver = make_receiver(backend, decode.kv_cache, ReceiverOptions(timeout_s=30))
        prompt = list(range(1, 200))
        try:
            response = await _prefill(stub, "r", prompt, GREEDY)
            handle: KVHandle = handle_from_proto(response.lease)
            block_ids = decode.reserve_prefilled(_prefilled(response, prompt))
            assert block_ids is not None
            pull = asyncio.create_task(receiver.pull(handle, block_ids))
            await asyncio.sleep(0)  # let it start
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            decode.abort("r")
            # The lease survives a cancelled pull until the decode side (here: we) releases it.
            assert await _release(stub, response)
            await wait_for(lambda: all_blocks_free(stub), 30.0, "prefill blocks freed")
            decode.block_manager.check_no_leaks()
        finally:
            await receiver.close()
            await server.shutdown()

    asyncio.run(run())


def test_a_traced_pull_puts_the_senders_span_under_the_pullers(
    backend: str, llama_dir: Path, otlp_receiver: OtlpReceiver
) -> None:
    """The trace context a pull is given reaches the sender (in gRPC metadata, a Ray ticket or
    a NIXL checkout): its ``prefill_worker.kv_send`` spans hang under the puller's span,
    exported over real OTLP. An untraced pull adds no span."""
    decode = LLMEngine(engine_config(llama_dir))
    tracing.configure(TracingConfig(endpoint=otlp_receiver.endpoint), "kv-contract", roots=True)
    tracer = tracing.tracer()
    assert tracer is not None

    async def run() -> None:
        _, server = await start_prefill(llama_dir, kv_backend=backend)
        stub = prefill_stub(server)
        receiver = make_receiver(backend, decode.kv_cache, ReceiverOptions(timeout_s=30))
        try:
            for i, traced in enumerate((False, True)):
                prompt = list(range(1 + i, 40))
                response = await _prefill(stub, f"r{i}", prompt, GREEDY)
                handle = handle_from_proto(response.lease)
                block_ids = decode.reserve_prefilled(_prefilled(response, prompt))
                assert block_ids is not None
                pull_span = tracer.start_span("puller") if traced else None
                await receiver.pull(handle, block_ids, tracing.metadata(pull_span))
                if pull_span is not None:
                    pull_span.end()
                decode.abort(f"r{i}")
                assert await _release(stub, response)
            await wait_for(lambda: all_blocks_free(stub), 30.0, "prefill blocks freed")
        finally:
            await receiver.close()
            await server.shutdown()

    try:
        asyncio.run(run())
    finally:
        tracing.shutdown()  # exports what is buffered
    spans = otlp_receiver.wait(lambda got: any(s.name == "puller" for s in got))
    (puller,) = [s for s in spans if s.name == "puller"]
    sends = [s for s in spans if s.name == "prefill_worker.kv_send"]
    assert sends and all(s.parent_id == puller.span_id for s in sends), spans
    assert {s.attributes["pdserve.kv_backend"] for s in sends} == {backend}
    # Ray stages a pull's layer ranges one checkout each; the others read once.
    assert all(s.attributes["pdserve.kv_blocks"] == 3 for s in sends)  # 38 tokens, 16 a block
    assert len(sends) == 1 or backend == "ray"
