"""A NIXL pull cancelled while its READ runs: the cancellation does not return until the READ's
thread has stopped, so nothing writes into the caller's blocks once ``pull`` has raised (the
contract in kvtransfer/base.py), and the checkout is returned."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import PrefilledRequest, SamplingParams
from kvtransfer.nixl_receiver import NixlKVReceiver
from kvtransfer.wire import handle_from_proto
from native_engine.llm_engine import LLMEngine
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import prefill_pb2
from tests.services.harness import (
    all_blocks_free,
    engine_config,
    prefill_stub,
    start_prefill,
    wait_for,
)

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_cancelled_during_the_read_waits_for_it_and_writes_nothing_after(llama_dir: Path) -> None:
    decode = LLMEngine(engine_config(llama_dir))

    async def run() -> None:
        service, server = await start_prefill(llama_dir, kv_backend="nixl")
        stub = prefill_stub(server)
        receiver = NixlKVReceiver(decode.kv_cache, timeout_s=30)
        started, gate = threading.Event(), threading.Event()
        finished: list[bool] = []
        real_read = receiver.agent.read

        def held_read(*args: Any) -> None:  # the READ, held in its thread until the gate opens
            started.set()
            gate.wait()
            try:
                real_read(*args)
            finally:
                finished.append(True)

        receiver.agent.read = held_read  # type: ignore[method-assign]
        prompt = list(range(1, 120))
        try:
            response = await stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="r", prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS)
                )
            )
            prefilled = PrefilledRequest("r", prompt, response.first_token_id, PARAMS, [])
            block_ids = decode.reserve_prefilled(prefilled)
            assert block_ids is not None
            pull = asyncio.create_task(receiver.pull(handle_from_proto(response.lease), block_ids))
            assert await asyncio.to_thread(started.wait, 30)
            pull.cancel()
            # The READ's thread still runs: the cancellation must not have returned.
            done, _ = await asyncio.wait([pull], timeout=0.5)
            assert not done and not finished
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await pull
            assert finished == [True]  # the thread ended before the cancellation returned
            # Nothing writes into the blocks any more: zeroed now, they stay zeroed.
            decode.kv_cache.tensor[:, :, block_ids] = 0
            assert not receiver.agent.busy()
            assert not torch.any(decode.kv_cache.tensor[:, :, block_ids])
            decode.abort("r")
            # The checkout was returned: once the lease ends, the prefill side frees everything.
            release = prefill_pb2.ReleaseRequest(
                request_id="r", lease_token=response.lease.lease_token
            )
            assert (await stub.Release(release)).released
            await wait_for(lambda: all_blocks_free(stub), 30.0, "prefill blocks freed")
            assert not service.leases
            decode.block_manager.check_no_leaks()
        finally:
            gate.set()
            await receiver.close()
            await server.shutdown()

    asyncio.run(run())
