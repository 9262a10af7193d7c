"""Decode honours max_num_seqs for requests prefilled elsewhere: 40 prefilled requests on a
worker with 4 seats never run more than 4 at once, the rest queue, and all complete exactly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import (
    compare,
    requests_for,
    run_streams,
    stats,
    survivors_hold_nothing,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(llama_dir: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        log_dir=tmp_path,
        decode_args=("--max-num-seqs", "4"),
        router_args=("--local-prefill-tokens", "0"),
    )
    with LocalCluster(config) as c:
        yield c


def test_forty_prefilled_requests_take_four_seats_at_a_time(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[11 + i, *range(30, 50)] for i in range(40)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 40
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)
    decode = cluster.decode[0]

    async def run() -> None:
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        running: list[int] = []
        queued: list[int] = []
        while not all(t.done() for t in tasks):
            s = await stats(decode)
            running.append(s.num_running)
            queued.append(s.num_waiting)
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
        assert max(running) <= 4, running
        assert max(running) == 4 and max(queued) > 0  # seats were full and requests queued
        compare(llm, streams, references, params)
        await wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "nothing held")

    asyncio.run(run())
