"""Faults while requests wait in the router's flow control queues (docs/slo.md), on a real
cluster (router, one prefill and two decode workers, real processes, Redis): the router keeps
one prompt in flight at a time, so most requests wait in its queues.

- Clients that leave while waiting take their place with them: the others are all served,
  the same tokens as one engine's, and afterwards nothing waits and nothing counts in flight.
- kill -9 of the prefill worker while requests wait: the supervisor restarts it, every request
  is served (the one in flight re-planned), one engine's tokens each, and nothing is left
  counted or held.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import (
    metric,
    requests_for,
    restarted,
    run_streams,
    survivors_hold_nothing,
    two_decode_workers,
)
from tests.services.harness import wait_for

ONE_AT_A_TIME = ("--inflight-tokens-per-worker", "1")
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(n)]


async def _waiting(cluster: LocalCluster, at_least: int) -> None:
    async def enough() -> bool:
        found = await asyncio.to_thread(metric, cluster.router, "pdserve_flow_queued_requests")
        return found >= at_least

    await wait_for(enough, 120.0, f"{at_least} requests waiting in the router")


async def _drained(cluster: LocalCluster) -> None:
    """Nothing waits in the router, nothing counts in flight, no worker holds anything."""

    async def empty() -> bool:
        queued = await asyncio.to_thread(metric, cluster.router, "pdserve_flow_queued_requests")
        inflight = await asyncio.to_thread(
            metric, cluster.router, "pdserve_flow_inflight_prompt_tokens"
        )
        return queued == 0 and inflight == 0 and await survivors_hold_nothing(cluster)

    await wait_for(empty, 60.0, "the router's queues and the workers empty")


@pytest.mark.parametrize("fault", ["clients_leave", "prefill_killed"])
def test_faults_while_requests_wait_in_the_router_leave_nothing_behind(
    fault: str,
    llama_dir: Path,
    redis_url: str,
    tmp_path: Path,
    make_llm: Callable[..., LLM],
) -> None:
    prompts = _prompts(16, seed=11)
    reference = [o.token_ids for o in make_llm(llama_dir).generate(prompts, PARAMS)]
    config = two_decode_workers(llama_dir, redis_url, tmp_path, router_args=ONE_AT_A_TIME)
    with LocalCluster(config) as cluster:

        async def run() -> None:
            requests = requests_for(prompts, [PARAMS] * len(prompts))
            streams, tasks = await run_streams(cluster.address, requests)
            await _waiting(cluster, 8)
            gone: set[int] = set()
            if fault == "clients_leave":
                gone = {3, 5, 8, 11, 13, 15}  # late arrivals: still waiting
                for i in gone:
                    tasks[i].cancel()
            else:
                victim = cluster.prefill[0]
                victim.process.send_signal(signal.SIGKILL)
                await wait_for(lambda: restarted(cluster, victim), 120.0, "prefill restarted")
            await asyncio.gather(*tasks, return_exceptions=True)
            for i, stream in enumerate(streams):
                if i in gone:
                    continue
                assert stream.error is None, f"stream {i}: {stream.error}"
                assert stream.token_ids == reference[i], f"stream {i}"
            await _drained(cluster)

        asyncio.run(run())
