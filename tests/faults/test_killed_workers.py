"""kill -9 mid-flight: a decode worker with 16 streams on it, a prefill worker inside a long
chunked prefill. Every stream completes with one engine's tokens and text (migration), the
supervisor restarts the killed process, and no surviving worker holds anything afterwards."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.local_cluster import ClusterConfig, Component, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import (
    compare,
    kill_a_decode_worker_mid_stream,
    metric,
    requests_for,
    run_streams,
    stats,
    survivors_hold_nothing,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=2,
        num_decode=2,
        redis_url=redis_url,
        log_dir=tmp_path,
        # Every stream is disaggregated, and chunked prefills are long.
        prefill_args=("--max-num-batched-tokens", "8"),
        redis_namespace=tmp_path.name,
        router_args=("--local-prefill-tokens", "0"),
    )
    with LocalCluster(config) as c:
        yield c


def _kill(component: Component) -> None:
    component.process.send_signal(signal.SIGKILL)


def test_decode_killed_mid_stream_every_stream_completes_exactly(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[3 + i, *range(40, 40 + 10 + 3 * i)] for i in range(16)]
    kill_a_decode_worker_mid_stream(cluster, prompts, make_llm(llama_dir))


@pytest.mark.parametrize("mode", ["colocated", "local-prefill"])
def test_streams_on_the_local_paths_migrate_too(
    mode: str, llama_dir: Path, redis_url: str, tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """Colocated workers, and short prompts prefilled on the decode worker (conditional
    disaggregation): a killed worker's streams continue elsewhere, exactly."""
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=0 if mode == "colocated" else 1,
        num_decode=2,
        colocated=mode == "colocated",
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
    )
    prompts = [[3 + i, *range(50, 50 + 8 + i)] for i in range(8)]  # short: prefilled locally
    with LocalCluster(config) as cluster:
        kill_a_decode_worker_mid_stream(cluster, prompts, make_llm(llama_dir))
        decisions = metric(cluster.router, "pdserve_routing_decisions_total", 'pool="decode"')
        assert decisions >= len(prompts)  # they did take the local path


def test_prefill_killed_in_a_long_chunked_prefill_is_retried(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [list(range(5, 5 + 480))]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)

    async def run() -> None:
        before = metric(cluster.router, "pdserve_migrations_total", 'reason="prefill"')
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        busy: list[Component] = []

        async def prefilling() -> bool:
            for component in cluster.prefill:
                if (await stats(component)).num_running:
                    busy.append(component)
                    return True
            return bool(streams[0].token_ids)  # too late: it already prefilled

        await wait_for(prefilling, 60.0, "a prefill worker runs the prompt", poll_s=0.002)
        assert busy, "the prefill finished before it could be killed"
        _kill(busy[0])  # at once: some 60 chunk steps are still to go
        await asyncio.gather(*tasks)
        compare(llm, streams, references, params)
        after = metric(cluster.router, "pdserve_migrations_total", 'reason="prefill"')
        assert after == before + 1
        await wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "survivors hold nothing")

    asyncio.run(run())
