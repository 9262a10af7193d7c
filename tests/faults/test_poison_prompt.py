"""A request that crashes every worker that runs it, with 3 prefill workers and no restarts
(router/quarantine.py). Killing silently (``--fault-exit-on-token``: the worker exits as a
crashing process would), it costs two prefill workers, not the pool: the client gets a named
INTERNAL error, the next normal request is served by the worker left, and the same request
again is refused before any worker sees it. Failing an engine step alone
(``--fault-raise-on-token``: the dead engine's last words name it), it costs one worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import compare, metric, requests_for, run_streams
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow

POISON = 7
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]


def _config(
    llama_dir: Path, redis_url: str, tmp_path: Path, fault: str, num_prefill: int
) -> ClusterConfig:
    return ClusterConfig(
        model=str(llama_dir),
        num_prefill=num_prefill,
        num_decode=1,
        redis_url=redis_url,
        log_dir=tmp_path,
        prefill_args=(fault, str(POISON)),
        redis_namespace=tmp_path.name,
        router_args=("--local-prefill-tokens", "0"),
        max_restarts=0,  # a dead worker stays dead: the test counts them
    )


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(_config(llama_dir, redis_url, tmp_path, "--fault-exit-on-token", 3)) as c:
        yield c


def _dead(cluster: LocalCluster) -> int:
    return sum(c.process.poll() is not None for c in cluster.prefill)


async def _one(address: str, prompt: list[int]) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    streams, tasks = await run_streams(address, requests_for([prompt], PARAMS))
    await asyncio.gather(*tasks)
    return streams[0].token_ids, streams[0].error


def test_a_poison_prompt_costs_two_workers_not_the_pool(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    poison = [*range(20, 60), POISON, *range(60, 80)]
    normal = list(range(100, 160))
    llm = make_llm(llama_dir)
    references = llm.generate([normal], PARAMS)

    async def run() -> None:
        tokens, error = await _one(cluster.address, poison)
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL, error
        assert "request quarantined" in (error.details() or "")
        assert tokens == []

        async def two_exited() -> bool:  # the router saw the second go; its exit is reaped next
            return _dead(cluster) == 2

        # The one it crashed first and the one that confirmed it.
        await wait_for(two_exited, 60.0, "the two workers the prompt crashed exit")
        assert metric(cluster.router, "pdserve_quarantined_requests_total", "ended") == 1

        streams, tasks = await run_streams(cluster.address, requests_for([normal], PARAMS))
        await asyncio.gather(*tasks)
        compare(llm, streams, references, PARAMS)

        tokens, error = await _one(cluster.address, poison)
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL, error
        assert "refused for quarantine_s" in (error.details() or "")
        assert _dead(cluster) == 2  # refused before any worker saw it
        assert metric(cluster.router, "pdserve_quarantined_requests_total", "refused") == 1

    asyncio.run(run())


def test_a_request_whose_step_fails_alone_costs_one_worker(
    llama_dir: Path, redis_url: str, tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """The engine's last words (the failed step held this request only) end it at once: no
    second worker is tried, the other serves the next request exactly, and the request is
    refused afterwards."""
    poison = [*range(20, 60), POISON, *range(60, 80)]
    normal = list(range(100, 160))
    llm = make_llm(llama_dir)
    references = llm.generate([normal], PARAMS)
    config = _config(llama_dir, redis_url, tmp_path, "--fault-raise-on-token", 2)

    async def run(cluster: LocalCluster) -> None:
        tokens, error = await _one(cluster.address, poison)
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL, error
        assert "failed stepping it alone" in (error.details() or ""), error.details()
        assert tokens == []

        async def exited() -> bool:  # the dead engine's worker stops, as a supervisor wants
            return _dead(cluster) == 1

        await wait_for(exited, 60.0, "the worker whose engine died exits")
        assert metric(cluster.router, "pdserve_quarantined_requests_total", "ended") == 1
        assert metric(cluster.router, "pdserve_migrations_total") == 0

        streams, tasks = await run_streams(cluster.address, requests_for([normal], PARAMS))
        await asyncio.gather(*tasks)
        compare(llm, streams, references, PARAMS)

        tokens, error = await _one(cluster.address, poison)
        assert error is not None and "refused for quarantine_s" in (error.details() or "")
        assert _dead(cluster) == 1

    with LocalCluster(config) as cluster:
        asyncio.run(run(cluster))
