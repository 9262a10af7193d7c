"""The trace collector is down, then comes up: requests never wait on it (their tokens are
one engine's), the workers and the router stop cleanly while it is down (each export gives
up after a bound), and once a collector listens at the address the traces of new requests
arrive there."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import requests_for, run_streams
from tests.services.otlp_receiver import OtlpReceiver, traced_cluster

pytestmark = pytest.mark.slow


def test_a_collector_down_costs_requests_nothing_and_its_return_gets_traces(
    llama_dir: Path, redis_url: str, tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    config = traced_cluster(llama_dir, redis_url, tmp_path, f"http://127.0.0.1:{port}")
    prompts = [[3 + i, *range(40, 60)] for i in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 4
    expected = [o.token_ids for o in make_llm(llama_dir).generate(prompts, params)]

    async def serve() -> None:
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        await asyncio.gather(*tasks)
        assert [s.error for s in streams] == [None] * 4
        assert [s.token_ids for s in streams] == expected

    cluster = LocalCluster(config)
    cluster.start()
    try:
        asyncio.run(serve())  # the collector is down
        with OtlpReceiver(port) as receiver:  # it comes up at the address
            asyncio.run(serve())
            receiver.wait(lambda got: sum(s.name == "pdserve.request" for s in got) >= 4)
        asyncio.run(serve())  # down again
    finally:
        codes = cluster.stop()
    assert set(codes.values()) == {0}  # every component drained and exited cleanly
