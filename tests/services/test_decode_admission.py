"""A Decode call for a request id the decode worker already serves is refused by name
(INVALID_ARGUMENT, "already in use"), and the request holding the id is left alone: it streams
to the end, equal to a run of its own, and every block comes back (a refused call must never
abort the id it was refused)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from engine import SamplingParams
from tests.services.harness import (
    both_sides_freed,
    decode_stub,
    disaggregated,
    prefilled_request,
    start_decode,
    start_prefill,
)

PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 90))
BOUND_S = 120.0


def test_a_second_decode_of_a_live_id_is_refused_and_the_first_goes_on(llama_dir: Path) -> None:
    async def run() -> None:
        _, prefill_server = await start_prefill(llama_dir)
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        try:
            want = await disaggregated(prefill_server, decode_server, PROMPT, PARAMS, "ref")
            request = await prefilled_request(prefill_server, PROMPT, PARAMS, "dup")
            first = decode_stub(decode_server).Decode(request)
            got: list[int] = []
            async for response in first:  # until it is admitted: the engine holds "dup"
                got += response.tokens.token_ids
                if response.HasField("admitted"):
                    break
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in decode_stub(decode_server).Decode(request):
                    pass
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id 'dup' is already in use" in (refused.value.details() or "")
            async with asyncio.timeout(BOUND_S):  # (an aborted holder would wait for ever)
                async for response in first:
                    got += response.tokens.token_ids
            assert got == want
            await both_sides_freed(prefill_server, decode_server)
        finally:
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())
