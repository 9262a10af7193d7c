"""SIGSTOP of a decode worker mid-stream (a frozen process: no TCP reset, no error): its streams
migrate within the stall timeout, new requests avoid it once its stats calls time out, and
after SIGCONT it rejoins, serves, and holds nothing of the streams it lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from native_engine import LLM
from tests.faults.faults_util import (
    busiest_decode_worker_mid_stream,
    compare,
    metric,
    mixed_params,
    requests_for,
    run_streams,
    stats,
    survivors_hold_nothing,
    two_decode_workers,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
STALL_S = 6.0  # well above the 1 s heartbeats, on a loaded machine too


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    stall = ("--stall-timeout-s", str(STALL_S))
    config = two_decode_workers(llama_dir, redis_url, tmp_path, router_args=stall)
    with LocalCluster(config) as c:
        try:
            yield c
        finally:
            for component in c.decode:  # never leave a stopped process behind
                if component.process.poll() is None:
                    os.kill(component.process.pid, signal.SIGCONT)


def test_stopped_decode_worker_streams_migrate_and_it_rejoins_after_sigcont(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[9 + i, *range(60, 70 + 2 * i)] for i in range(8)]
    params = mixed_params(8, max_tokens=150)
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)

    async def run() -> None:
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        victim = await busiest_decode_worker_mid_stream(cluster, streams)
        pulls = metric(victim, "pdserve_kv_transfer_seconds_count")
        os.kill(victim.process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        await asyncio.gather(*tasks)
        # The streams moved once the worker was found frozen: its registry record expired and
        # a stats call timed out (worker.lost), or the stall timeout passed, whichever first.
        print(f"streams done {time.monotonic() - stopped_at:.1f} s after the SIGSTOP")
        print("\n".join(compare(llm, streams, references, params)))
        assert metric(cluster.router, "pdserve_migrations_total", 'reason="stall"') >= 1

        async def left_routing() -> bool:
            return metric(cluster.router, "pdserve_router_healthy_workers", 'pool="decode"') == 1

        await wait_for(left_routing, 30.0, "the stopped worker leaves routing")
        migrations = metric(cluster.router, "pdserve_migrations_total")
        more, more_tasks = await run_streams(cluster.address, requests_for(prompts, params))
        await asyncio.gather(*more_tasks)
        compare(llm, more, references, params)
        assert metric(cluster.router, "pdserve_migrations_total") == migrations  # avoided it

        os.kill(victim.process.pid, signal.SIGCONT)

        async def rejoined() -> bool:
            return metric(cluster.router, "pdserve_router_healthy_workers", 'pool="decode"') == 2

        await wait_for(rejoined, 30.0, "the resumed worker rejoins")
        # It dropped the streams the router cancelled, and serves again.
        await wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "nothing held anywhere")
        served = (await stats(victim)).num_prompt_tokens_computed

        async def victim_serves() -> bool:
            _, one = await run_streams(cluster.address, requests_for(prompts[:2], params[:2]))
            await asyncio.gather(*one)
            return metric(victim, "pdserve_kv_transfer_seconds_count") > pulls

        await wait_for(victim_serves, 60.0, "the resumed worker takes new streams", poll_s=0.1)
        assert served == 0  # decode workers compute no prompt token

    asyncio.run(run())
