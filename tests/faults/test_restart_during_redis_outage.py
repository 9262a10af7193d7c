"""Redis down, then the router and a decode worker restarted: they must come back from the
workers they last knew (``pdserve/cluster/last_known.py``), not crash-loop on the registry
(the router) or refuse every KV handle (the decode worker's peer check), and serve exactly."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.embedded_redis import EmbeddedRedis
from app.local_cluster import ClusterConfig, Component, LocalCluster
from native_engine import LLM
from tests.faults.faults_util import (
    compare,
    metric,
    mixed_params,
    requests_for,
    restarted,
    run_streams,
    survivors_hold_nothing,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:  # its own server: this test stops it
        yield server


@pytest.fixture
def cluster(llama_dir: Path, redis: EmbeddedRedis, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        redis_url=redis.url,
        log_dir=tmp_path,
        router_args=("--local-prefill-tokens", "0"),  # every stream pulls KV from a peer
    )
    with LocalCluster(config) as c:
        yield c


def test_router_and_decode_worker_restarted_while_redis_is_down_serve_exactly(
    cluster: LocalCluster,
    redis: EmbeddedRedis,
    llama_dir: Path,
    make_llm: Callable[..., LLM],
    tmp_path: Path,
) -> None:
    prompts = [[31 + i, *range(60, 75 + i)] for i in range(4)]
    params = mixed_params(4, max_tokens=24)
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)

    async def serve() -> None:
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        await asyncio.gather(*tasks)
        compare(llm, streams, references, params)

    async def kill_and_wait(victim: Component) -> None:
        victim.process.send_signal(signal.SIGKILL)
        await wait_for(lambda: restarted(cluster, victim), 180.0, f"{victim.name} serves again")

    async def scenario() -> None:
        await serve()  # every component has read the registry (and kept what it read)
        redis.stop()
        await kill_and_wait(cluster.decode[0])
        assert cluster.router is not None
        await kill_and_wait(cluster.router)
        assert metric(cluster.router, "pdserve_redis_up") == 0
        await serve()
        await wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "nothing held")

    asyncio.run(scenario())
    assert "last-known workers" in (tmp_path / "router.log").read_text()
    # Redis still down: every component drains and exits 0. (The workers' registry loop
    # spun on the refused connection once a drain asked for an early beat, and never exited.)
    assert set(cluster.stop().values()) == {0}
