"""A client that stops reading: the decode worker's buffered output for it never exceeds its
bound (the request is paused: blocks kept, no seat), and after the router's client idle
timeout the request is cancelled and every block freed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import router_pb2, router_pb2_grpc
from tests.faults.faults_util import metric, stats, survivors_hold_nothing
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
BOUND = 32
IDLE_S = 4.0


@pytest.fixture
def cluster(llama_dir: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        log_dir=tmp_path,
        decode_args=("--max-buffered-tokens", str(BOUND)),
        router_args=("--local-prefill-tokens", "0", "--client-idle-timeout-s", str(IDLE_S)),
    )
    with LocalCluster(config) as c:
        yield c


def test_a_client_that_stops_reading_is_paused_then_cancelled(cluster: LocalCluster) -> None:
    decode = cluster.decode[0]
    params = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True, logprobs=20)
    request = router_pb2.GenerateRequest(
        prompt_token_ids=list(range(7, 15)), sampling=sampling_to_proto(params)
    )

    async def run() -> None:
        # A small receive window, as a slow client on a slow link has.
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 8192)]
        async with grpc.aio.insecure_channel(cluster.address, options=options) as channel:
            call = router_pb2_grpc.RouterStub(channel).Generate(request)
            await call.read()  # the first token; then the client reads nothing
            seen: list[float] = []

            async def paused() -> bool:
                seen.append(metric(decode, "pdserve_output_buffered_tokens"))
                s = await stats(decode)
                return s.num_paused == 1 and s.num_running == 0

            await wait_for(paused, 60.0, "the unread request is paused", poll_s=0.02)
            assert max(seen) <= BOUND and seen[-1] > 0, seen
            s = await stats(decode)
            assert s.num_free_blocks < s.num_blocks  # paused: its blocks stay
            # The router gives up on the client after the idle timeout and frees everything.
            await wait_for(lambda: survivors_hold_nothing(cluster), IDLE_S + 30.0, "freed")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() != grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED
            assert "client_idle_timeout_s" in (err.value.details() or "")
        assert metric(cluster.router, "pdserve_client_idle_cancels_total") == 1
        assert metric(decode, "pdserve_output_buffered_tokens") == 0

    asyncio.run(run())
