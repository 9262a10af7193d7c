"""``pdserve up`` on a shared host: the workers' plaintext loopback ports are reachable by any
local user, who could generate past the router's API keys (``PrefillAndDecode``) or pull KV.
With the cluster's random token on every internal call, a call without it is refused
(UNAUTHENTICATED) while the router, which has it, serves; health checks stay open."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.peer_token import METADATA_KEY
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2
from tests.integration.cluster_util import generate_many, start_up

pytestmark = pytest.mark.slow


def test_worker_ports_refuse_calls_without_the_clusters_token(llama_dir: Path) -> None:
    lines: list[str] = []
    process, address = start_up("--model", str(llama_dir), "--port", "0", seen=lines)
    try:
        decode = next(line.split()[1] for line in lines if line.split()[:1] == ["decode-0"])
        sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

        async def scenario() -> None:
            async with grpc.aio.insecure_channel(decode) as channel:
                stub = decode_pb2_grpc.DecodeWorkerStub(channel)
                request = decode_pb2.PrefillAndDecodeRequest(
                    request_id="x", prompt_token_ids=[1, 2, 3], sampling=sampling
                )
                for metadata in ((), ((METADATA_KEY, "guess"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for _ in stub.PrefillAndDecode(request, metadata=metadata):
                            pass
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.aio.AioRpcError) as stats:
                        await stub.GetStats(common_pb2.GetStatsRequest(), metadata=metadata)
                    assert stats.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest()
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes: open
            request = router_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling)
            (result,) = await generate_many(address, [request])  # the router has the token
            assert len(result.token_ids) == 8

        asyncio.run(scenario())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
