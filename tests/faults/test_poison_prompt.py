"""A prompt that crashes every worker that runs it (``--fault-exit-on-token``: the worker exits
as a crashing engine would), with 3 prefill workers and no restarts: it costs two prefill
workers, not the pool (router/quarantine.py). The client gets a named INTERNAL error, the next
normal request is served by the worker left, and the same prompt again is refused before any
worker sees it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve.app.local_cluster import ClusterConfig, LocalCluster
from tests.faults.faults_util import compare, metric, requests_for, run_streams

pytestmark = pytest.mark.slow

POISON = 7
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=3,
        num_decode=1,
        redis_url=redis_url,
        log_dir=tmp_path,
        prefill_args=("--fault-exit-on-token", str(POISON)),
        redis_namespace=tmp_path.name,
        router_args=("--local-prefill-tokens", "0"),
        max_restarts=0,  # a dead worker stays dead: the test counts them
    )
    with LocalCluster(config) as c:
        yield c


def _dead(cluster: LocalCluster) -> int:
    return sum(c.process.poll() is not None for c in cluster.prefill)


def test_a_poison_prompt_costs_two_workers_not_the_pool(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    poison = [*range(20, 60), POISON, *range(60, 80)]
    normal = list(range(100, 160))
    llm = make_llm(llama_dir)
    references = llm.generate([normal], PARAMS)

    async def one(prompt: list[int]) -> tuple[list[int], grpc.aio.AioRpcError | None]:
        streams, tasks = await run_streams(cluster.address, requests_for([prompt], PARAMS))
        await asyncio.gather(*tasks)
        return streams[0].token_ids, streams[0].error

    async def run() -> None:
        tokens, error = await one(poison)
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL, error
        assert "prompt quarantined" in (error.details() or "")
        assert tokens == []
        assert _dead(cluster) == 2  # the one it crashed first and the one that confirmed it
        assert metric(cluster.router, "pdserve_quarantined_requests_total", "ended") == 1

        streams, tasks = await run_streams(cluster.address, requests_for([normal], PARAMS))
        await asyncio.gather(*tasks)
        compare(llm, streams, references, PARAMS)

        tokens, error = await one(poison)
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL, error
        assert "refused for quarantine_s" in (error.details() or "")
        assert _dead(cluster) == 2  # refused before any worker saw it
        assert metric(cluster.router, "pdserve_quarantined_requests_total", "refused") == 1

    asyncio.run(run())
