"""``pdserve up``: one ready line, serves, and on SIGTERM drains without dropping a stream."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from app.client import router_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.cluster_util import start_up

pytestmark = pytest.mark.slow


def test_up_serves_and_drains_in_flight_stream_on_sigterm(llama_dir: Path) -> None:
    process, address = start_up("--model", str(llama_dir), "--port", "0")
    try:
        assert process.stdout is not None

        async def scenario() -> list[int]:
            sampling = common_pb2.SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
            request = router_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling)
            async with router_channel(address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                call = stub.Generate(request)
                tokens: list[int] = []
                async for response in call:
                    if response.HasField("chunk"):
                        if not tokens:
                            process.send_signal(signal.SIGTERM)  # scale-down mid-stream
                        tokens.extend(response.chunk.token_ids)
                    else:
                        assert response.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
                return tokens

        tokens = asyncio.run(scenario())
        assert len(tokens) == 150  # the in-flight stream finished during the drain
        rest = process.stdout.read()
        assert process.wait(timeout=60) == 0
        assert "stopped" in rest
    finally:
        if process.poll() is None:
            process.kill()
