"""A stuck engine step: the worker process answers (heartbeats, stats, TCP) but one step never
returns, blocked outside the GIL as a hung device sync is (the workers' fault-injection flag
``--fault-stall-at-step``). Nothing but progress tells: the worker reports how long its engine
has had work without completing a step (``engine_stalled_s``), the router stops routing to it
once that reaches its stall timeout and gives up on its calls, and its ``/livez`` fails.

- A stuck decode step: every stream completes with one engine's tokens (its streams migrate),
  the worker leaves routing, its liveness probe fails.
- A stuck prefill step: every request completes, prefilled again on the other prefill worker.

Before: the stuck worker's streams heartbeated for ever and hung until the client's deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.local_cluster import Component, LocalCluster
from native_engine import LLM
from pdserve.common.role import Role
from tests.faults.faults_util import (
    compare,
    metric,
    mixed_params,
    requests_for,
    run_streams,
    stats,
    two_decode_workers,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
STALL_S = 5.0  # the router's: far above a tiny model's step, on a loaded machine too
LIVENESS_S = 3.0  # the stuck worker's own bound for /livez


def _stuck_worker_flags(step: int) -> tuple[str, ...]:
    return ("--fault-stall-at-step", str(step), "--liveness-stall-s", str(LIVENESS_S))


def _livez(component: Component) -> int:
    try:
        with urllib.request.urlopen(f"http://{component.metrics_address}/livez", timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _cluster(llama_dir: Path, redis_url: str, tmp_path: Path, *router_args: str) -> LocalCluster:
    """One prefill and one decode worker; the test adds the worker whose step sticks."""
    config = two_decode_workers(
        llama_dir,
        redis_url,
        tmp_path,
        router_args=("--stall-timeout-s", str(STALL_S), *router_args),
    )
    # A stuck worker cannot drain (its step holds the engine): it is killed, not restarted.
    config = dataclasses.replace(config, num_decode=1, max_restarts=0, stop_timeout_s=5.0)
    return LocalCluster(config)


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    with _cluster(llama_dir, redis_url, tmp_path) as c:
        yield c


@pytest.fixture
def round_robin(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    """Decode placement in turn: half the streams go to the stuck worker."""
    with _cluster(llama_dir, redis_url, tmp_path, "--decode-policy", "round_robin") as c:
        yield c


async def _joined(cluster: LocalCluster, role: Role, count: int) -> None:
    pool = f'pool="{role.value}"'

    async def routed() -> bool:
        return metric(cluster.router, "pdserve_router_healthy_workers", pool) == count

    await wait_for(routed, 60.0, f"{count} routable {role.value} workers")


def _add_stuck_worker(cluster: LocalCluster, role: Role, step: int) -> Component:
    worker = cluster.spawn_worker(role, _stuck_worker_flags(step))
    worker.wait_ready(cluster.config.ready_timeout_s)
    return worker


def test_a_stuck_decode_step_migrates_its_streams_and_fails_liveness(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[9 + i, *range(60, 70 + 2 * i)] for i in range(8)]
    params = mixed_params(8, max_tokens=120)
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)
    victim = _add_stuck_worker(cluster, Role.DECODE, step=30)

    async def run() -> None:
        await _joined(cluster, Role.DECODE, 2)
        assert _livez(victim) == 200
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        await asyncio.gather(*tasks)
        print("\n".join(compare(llm, streams, references, params)))
        assert metric(cluster.router, "pdserve_migrations_total", 'reason="stall"') >= 1
        held = await stats(victim)
        assert held.engine_stalled_s >= STALL_S  # it answers, and says it is stuck
        assert held.num_running > 0  # the streams it lost are still in its stuck step
        assert metric(victim, "pdserve_engine_stalled_seconds") >= STALL_S  # what an operator sees
        await _joined(cluster, Role.DECODE, 1)
        assert _livez(victim) == 503  # past --liveness-stall-s: the orchestrator restarts it

        migrations = metric(cluster.router, "pdserve_migrations_total")
        more, more_tasks = await run_streams(cluster.address, requests_for(prompts, params))
        await asyncio.gather(*more_tasks)
        compare(llm, more, references, params)
        assert metric(cluster.router, "pdserve_migrations_total") == migrations  # avoided it

    try:
        asyncio.run(run())
    finally:
        victim.process.kill()


def test_admissions_waiting_behind_a_stuck_decode_step_move_on(
    round_robin: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """The stuck worker's first step never returns, so its later admissions (reserve, pull,
    admit: engine calls between steps) wait behind it while the worker heartbeats them. They
    must move on once the worker turns unroutable, like its streams. Before, admission watched
    only the prefill worker: those requests hung until the client's deadline."""
    cluster = round_robin
    prompts = [[40 + i, *range(100, 112 + i)] for i in range(8)]
    params = mixed_params(8, max_tokens=24)
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)
    victim = _add_stuck_worker(cluster, Role.DECODE, step=1)

    async def run() -> None:
        await _joined(cluster, Role.DECODE, 2)
        streams, tasks = await run_streams(
            cluster.address, requests_for(prompts, params), timeout_s=120.0
        )
        await asyncio.gather(*tasks)
        print("\n".join(compare(llm, streams, references, params)))
        assert metric(cluster.router, "pdserve_migrations_total", 'reason="stall"') >= 2

    try:
        asyncio.run(run())
    finally:
        victim.process.kill()


def test_a_stuck_prefill_step_is_given_up_on_and_prefilled_elsewhere(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[5 + i, *range(30, 50 + i)] for i in range(4)]
    params = mixed_params(4, max_tokens=16)
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)
    victim = _add_stuck_worker(cluster, Role.PREFILL, step=1)

    async def run() -> None:
        await _joined(cluster, Role.PREFILL, 2)
        streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
        await asyncio.gather(*tasks)
        print("\n".join(compare(llm, streams, references, params)))
        held = await stats(victim)
        assert held.engine_stalled_s >= STALL_S
        assert held.num_prompt_tokens_computed == 0  # its one step never completed
        # Whichever requests it took were given up on and prefilled on the other worker.
        other = next(w for w in cluster.prefill if w is not victim)
        computed = (await stats(other)).num_prompt_tokens_computed
        assert computed >= sum(len(p) for p in prompts) - 16 * len(prompts)  # but cache hits
        await _joined(cluster, Role.PREFILL, 1)
        assert _livez(victim) == 503

    try:
        asyncio.run(run())
    finally:
        victim.process.kill()
