"""Redis killed and restarted while streams run, with a migration in flight: a decode worker is
killed while Redis is down, so the router migrates its streams over the workers it last knew.
Nothing is lost; after Redis returns the registry heals and the restarted worker rejoins."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.embedded_redis import EmbeddedRedis
from app.local_cluster import ClusterConfig, LocalCluster
from native_engine import LLM
from pdserve.cluster.registry import Registry
from tests.faults.faults_util import (
    busiest_decode_worker_mid_stream,
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
    with EmbeddedRedis() as server:  # its own server: this test kills and restarts it
        yield server


@pytest.fixture
def cluster(llama_dir: Path, redis: EmbeddedRedis, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_decode=2,
        redis_url=redis.url,
        log_dir=tmp_path,
        router_args=("--local-prefill-tokens", "0"),
    )
    with LocalCluster(config) as c:
        yield c


def test_redis_down_and_a_decode_worker_killed_lose_no_stream(
    cluster: LocalCluster, redis: EmbeddedRedis, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[21 + i, *range(80, 92 + i)] for i in range(8)]
    params = mixed_params(8, max_tokens=150)
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)

    async def run() -> None:
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        victim = await busiest_decode_worker_mid_stream(cluster, streams)
        redis.stop()
        victim.process.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
        print("\n".join(compare(llm, streams, references, params)))
        assert metric(cluster.router, "pdserve_migrations_total") >= 1
        assert metric(cluster.router, "pdserve_redis_up") == 0
        redis.start()  # empty, same port

        async def healed() -> bool:
            workers = {r.worker_id for r in await Registry.workers_at(redis.url)}
            live = {c.worker_id for c in cluster.components if c.worker_id and c.address}
            return await restarted(cluster, victim) and live <= workers

        await wait_for(healed, 60.0, "the registry lists every live worker again")
        await wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "nothing held")
        again, again_tasks = await run_streams(cluster.address, requests_for(prompts, params))
        await asyncio.gather(*again_tasks)
        compare(llm, again, references, params)

    asyncio.run(run())
