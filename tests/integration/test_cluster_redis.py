"""A cluster on Redis, as separate processes: workers join at runtime, drain without dropping a
stream, and serving survives Redis dying and coming back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from app.client import router_channel
from app.embedded_redis import EmbeddedRedis
from app.local_cluster import ClusterConfig as LocalClusterConfig
from app.local_cluster import Component, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.cluster.registry import Registry
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from tests.integration.cluster_util import generate_many, run
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:  # its own server: this test kills and restarts it
        yield server


@pytest.fixture
def cluster(llama_dir: Path, redis: EmbeddedRedis, tmp_path: Path) -> Iterator[LocalCluster]:
    config = LocalClusterConfig(
        model=str(llama_dir),
        redis_url=redis.url,
        log_dir=tmp_path,
        router_args=("--local-prefill-tokens", "0"),  # traffic is counted by KV pulls
    )
    with LocalCluster(config) as c:
        yield c


def _served(component: Component) -> int:
    """KV pulls a decode worker completed (its Prometheus counter)."""
    with urllib.request.urlopen(f"http://{component.metrics_address}/metrics") as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("pdserve_kv_transfer_seconds_count"):
                return int(float(line.split()[-1]))
    return 0


def _cli(*args: str) -> str:
    command = [sys.executable, "-m", "app", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout


def test_decode_added_at_runtime_gets_traffic_and_drain_drops_no_stream(
    cluster: LocalCluster, redis: EmbeddedRedis
) -> None:
    added = cluster.spawn_worker(Role.DECODE)
    added.wait_ready(120)
    request = router_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=GREEDY)

    async def new_worker_served() -> bool:
        await generate_many(cluster.address, [request])
        return _served(added) > 0

    # Discovery (the router polls every 0.5 s): the new worker takes traffic, no router restart.
    run(wait_for(new_worker_served, 30.0, "runtime-added decode worker receives traffic"))
    status = _cli("status", "--redis", redis.url)
    assert added.worker_id in status and "decode" in status and "prefill" in status

    async def drain_mid_stream() -> list[int]:
        sampling = common_pb2.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        long = router_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling)
        tokens: list[int] = []
        async with router_channel(cluster.address) as channel:
            async for response in router_pb2_grpc.RouterStub(channel).Generate(long):
                # From the second chunk on, the tokens come from a decode worker.
                if response.HasField("chunk") and tokens and not drained:
                    busy = await _busy_decode(cluster)
                    # Scale-down of the very worker streaming this request.
                    await asyncio.to_thread(_cli, "drain", busy.worker_id, "--redis", redis.url)
                    drained.append(busy)
                tokens.extend(response.chunk.token_ids)
        return tokens

    drained: list[Component] = []
    tokens = run(drain_mid_stream())
    assert len(tokens) == 300  # the stream finished on the draining worker
    assert drained[0].process.wait(timeout=60) == 0  # then it deregistered and exited
    remaining = run(Registry.workers_at(redis.url))
    assert drained[0].worker_id not in remaining
    # New work goes to the worker that is left.
    assert run(generate_many(cluster.address, [request]))[0].completion_tokens == 8


async def _busy_decode(cluster: LocalCluster) -> Component:
    for component in cluster.decode:
        if component.process.poll() is not None:
            continue
        async with grpc.aio.insecure_channel(component.address) as channel:
            stats = await decode_pb2_grpc.DecodeWorkerStub(channel).GetStats(
                common_pb2.GetStatsRequest()
            )
        if stats.num_running:
            return component
    raise AssertionError("no decode worker is running the stream")


def test_serving_survives_redis_dying_and_the_index_heals(
    cluster: LocalCluster, redis: EmbeddedRedis, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[7 + i] * (20 + i) for i in range(6)]
    requests = [router_pb2.GenerateRequest(prompt_token_ids=p, sampling=GREEDY) for p in prompts]
    reference = make_llm(llama_dir).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    redis.stop()  # Redis dies mid-run
    results = run(generate_many(cluster.address, requests))
    assert [r.token_ids for r in results] == [e.token_ids for e in reference]
    redis.start()  # an empty Redis on the same port

    config = RedisConfig(url=redis.url)
    prefill_id = cluster.prefill[0].worker_id

    async def rebuilt() -> bool:
        index = RedisPrefixIndex.from_url(config.url)
        try:
            workers = {r.worker_id for r in await Registry.workers_at(config.url)}
            return prefill_id in workers and await index.num_blocks(prefill_id) > 0
        finally:
            await index.close()

    # Workers re-register and re-publish a full snapshot of their caches.
    run(wait_for(rebuilt, 30.0, "registry and prefix index rebuilt after the Redis restart"))

    def router_metric(name: str, label: str = "") -> float:
        router = cluster.router
        assert router is not None
        with urllib.request.urlopen(f"http://{router.metrics_address}/metrics") as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name) and label in line:
                    return float(line.split()[-1])
        return 0.0

    async def router_sees_redis() -> bool:
        return router_metric("pdserve_redis_up ") == 1.0

    # The router's own discovery loop notices the return (it polls every 0.5 s).
    run(wait_for(router_sees_redis, 30.0, "router reports Redis reachable again"))

    def cache_decisions() -> float:
        return router_metric("pdserve_routing_decisions_total", 'reason="cache"')

    before = cache_decisions()
    run(generate_many(cluster.address, requests[:2]))  # prompts cached before the restart
    assert cache_decisions() >= before + 2  # cache-aware routing resumed
