"""KV stores fail (docs/kv-cache.md, "The store"), real processes: ``pdserve up``'s cluster with
two stores and a prefill worker that writes each evicted prefix to both. One store killed
(kill -9): the router plans the pull from the other, and the prompt's prefix still comes from
a store. Both killed: the prompt is computed. Both frozen (SIGSTOP): the pull meets its
deadline, and the prompt is computed. Either way the client gets one engine's tokens and no
live worker holds anything."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from app.client import generate
from app.component import Component
from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from engine.block_hash import hash_blocks, root_hash
from kvstore_service.config import KVStoreConfig
from kvstore_service.service import store_layout
from native_engine import LLM
from pdserve.cluster.prefix_index import ANY_TIER
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import router_pb2, router_pb2_grpc
from tests.faults.faults_util import metric, stats, survivors_hold_nothing
from tests.services.harness import disaggregated, wait_for
from tests.services.test_kv_store import PROMPTS, PULLABLE, host_gib

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PULL_TIMEOUT_S = 3.0


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=1,
        num_decode=1,
        num_kvstore=2,
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        prefill_args=(
            *("--num-blocks", "24", "--host-cache-gib", str(host_gib(llama_dir, 20))),
            *("--kv-store-replicas", "2"),
            *("--peer-pull-timeout-s", str(PULL_TIMEOUT_S)),
        ),
        router_args=("--prefill-policy", "cost", "--local-prefill-tokens", "0"),
        max_restarts=0,
    )
    with LocalCluster(config) as c:
        try:
            yield c
        finally:
            for store in c.kvstores:  # never leave a stopped process behind
                if store.process.poll() is None:
                    os.kill(store.process.pid, signal.SIGCONT)


async def offload_to_both(cluster: LocalCluster, model: Path, redis_url: str, ns: str) -> None:
    """Runs the prompts on the prefill worker until the first two are in both stores, the
    router routes to both, and the index shows the first prompt in the stores alone (the
    worker's host-tier evictions published: else the router, rightly, sends the prompt to
    the host tier it believes in)."""
    (prefill,), (decode,), stores = cluster.prefill, cluster.decode, cluster.kvstores
    router = cluster.router
    assert router is not None
    for i, prompt in enumerate([*PROMPTS, list(reversed(PROMPTS[2]))]):
        await disaggregated(prefill, decode, prompt, PARAMS, f"w{i}")
    layout = store_layout(KVStoreConfig(model=str(model)))
    keys = hash_blocks(root_hash(layout.model_fingerprint), PROMPTS[0][: PULLABLE * 16], 16)

    async def held_by_both() -> bool:
        held = [(await stats(s)).num_cached_blocks for s in stores]
        return min(held) >= 2 * PULLABLE

    async def only_in_stores() -> bool:
        index = RedisPrefixIndex.from_url(redis_url, ns)
        try:
            ids = [prefill.worker_id, *(s.worker_id for s in stores)]
            found = await index.longest_prefixes(keys, ids, ANY_TIER)
        finally:
            await index.close()
        return found[prefill.worker_id] == 0 and min(found[s.worker_id] for s in stores) == 18

    await wait_for(held_by_both, 60.0, "the first two prompts offloaded to both stores")
    await wait_for(lambda: routable_stores(router, 2), 60.0, "the router sees both stores")
    await wait_for(only_in_stores, 60.0, "the index shows the prompt in the stores alone")


async def ask(router: Component, prompt: list[int]) -> list[int]:
    async with grpc.aio.insecure_channel(router.address) as channel:
        request = router_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS)
        )
        stub = router_pb2_grpc.RouterStub(channel)
        return (await generate(stub, request, timeout_s=60)).token_ids


async def routable_stores(router: Component, n: int) -> bool:
    return metric(router, "pdserve_router_healthy_workers", 'pool="kvstore"') == n


def test_a_store_killed_leaves_its_replica_then_a_recompute(
    cluster: LocalCluster,
    llama_dir: Path,
    make_llm: Callable[..., LLM],
    redis_url: str,
    tmp_path: Path,
) -> None:
    want = [o.token_ids for o in make_llm(llama_dir).generate(PROMPTS[:2], PARAMS)]
    (prefill,), stores, router = cluster.prefill, cluster.kvstores, cluster.router
    assert router is not None

    async def run() -> None:
        await offload_to_both(cluster, llama_dir, redis_url, tmp_path.name)
        stores[0].kill()
        await wait_for(lambda: routable_stores(router, 1), 60.0, "the router sees one store")
        before = (await stats(prefill)).num_prompt_tokens_computed
        assert await ask(router, PROMPTS[0]) == want[0]
        assert (await stats(prefill)).num_prompt_tokens_computed == before + 9  # pulled
        stores[1].kill()
        assert await ask(router, PROMPTS[1]) == want[1]
        computed = (await stats(prefill)).num_prompt_tokens_computed
        assert computed == before + 9 + len(PROMPTS[1])  # all of it
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "nothing held")

    asyncio.run(run())
    assert metric(router, "pdserve_routing_decisions_total", 'reason="store"') >= 1


def test_frozen_stores_cost_a_bounded_wait_then_a_recompute(
    cluster: LocalCluster,
    llama_dir: Path,
    make_llm: Callable[..., LLM],
    redis_url: str,
    tmp_path: Path,
) -> None:
    """Both stores frozen (SIGSTOP: no reset, no answer) just as a prompt they hold comes: the
    worker's lease call to the store the plan names meets its deadline (or the router has
    already seen the stores stall and plans no pull), and the prompt is computed; offloads to
    the frozen stores time out without holding the worker up."""
    want = make_llm(llama_dir).generate([PROMPTS[0]], PARAMS)[0].token_ids
    (prefill,), router = cluster.prefill, cluster.router
    assert router is not None

    async def run() -> None:
        await offload_to_both(cluster, llama_dir, redis_url, tmp_path.name)
        failures = metric(prefill, "pdserve_kv_peer_pull_failures_total")
        for store in cluster.kvstores:
            os.kill(store.process.pid, signal.SIGSTOP)
        before = (await stats(prefill)).num_prompt_tokens_computed
        assert await ask(router, PROMPTS[0]) == want
        computed = (await stats(prefill)).num_prompt_tokens_computed
        assert computed - before == len(PROMPTS[0])  # a frozen store lends nothing
        # The pull met its deadline, unless the router saw both stores stall first.
        deadline = 'reason="holder_deadline_exceeded"'
        timed_out = metric(prefill, "pdserve_kv_peer_pull_failures_total", deadline)
        assert timed_out == failures + 1 or await routable_stores(router, 0)
        for store in cluster.kvstores:
            os.kill(store.process.pid, signal.SIGCONT)
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "nothing held")

    asyncio.run(run())
