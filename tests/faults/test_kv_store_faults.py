"""KV stores fail (docs/kv-cache.md, "The store"), real processes: ``pdserve up``'s cluster with
two stores and a prefill worker that writes each evicted prefix to both. One store killed
(kill -9): the router plans the pull from the other, and the prompt's prefix still comes from
a store. Both killed: the prompt is computed. Either way the client gets one engine's tokens
and no live worker holds anything."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from app.client import generate
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
        ),
        router_args=("--prefill-policy", "cost", "--local-prefill-tokens", "0"),
        max_restarts=0,
    )
    with LocalCluster(config) as c:
        yield c


def test_a_store_killed_leaves_its_replica_then_a_recompute(
    cluster: LocalCluster,
    llama_dir: Path,
    make_llm: Callable[..., LLM],
    redis_url: str,
    tmp_path: Path,
) -> None:
    want = [o.token_ids for o in make_llm(llama_dir).generate(PROMPTS[:2], PARAMS)]
    (prefill,), (decode,) = cluster.prefill, cluster.decode
    stores = cluster.kvstores
    router = cluster.router
    assert router is not None

    async def held_by_both() -> bool:
        held = [(await stats(s)).num_cached_blocks for s in stores]
        return min(held) >= 2 * PULLABLE

    layout = store_layout(KVStoreConfig(model=str(llama_dir)))
    keys = hash_blocks(root_hash(layout.model_fingerprint), PROMPTS[0][: PULLABLE * 16], 16)

    async def only_in_stores() -> bool:
        """The index shows the first prompt in the stores and no longer on the prefill
        worker (its host tier's evictions published: else the router, rightly, sends the
        prompt to the host tier it believes in)."""
        index = RedisPrefixIndex.from_url(redis_url, tmp_path.name)
        try:
            ids = [prefill.worker_id, *(s.worker_id for s in stores)]
            found = await index.longest_prefixes(keys, ids, ANY_TIER)
        finally:
            await index.close()
        return found[prefill.worker_id] == 0 and min(found[s.worker_id] for s in stores) == 18

    async def routable_stores(n: int) -> bool:
        return metric(router, "pdserve_router_healthy_workers", 'pool="kvstore"') == n

    async def ask(prompt: list[int]) -> list[int]:
        async with grpc.aio.insecure_channel(router.address) as channel:
            request = router_pb2.GenerateRequest(
                prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS)
            )
            return (await generate(router_pb2_grpc.RouterStub(channel), request)).token_ids

    async def run() -> None:
        for i, prompt in enumerate([*PROMPTS, list(reversed(PROMPTS[2]))]):
            await disaggregated(prefill, decode, prompt, PARAMS, f"w{i}")
        await wait_for(held_by_both, 60.0, "the first two prompts offloaded to both stores")
        await wait_for(lambda: routable_stores(2), 60.0, "the router sees both stores")
        await wait_for(only_in_stores, 60.0, "the index shows the prompt in the stores alone")
        stores[0].kill()
        await wait_for(lambda: routable_stores(1), 60.0, "the router sees one store")
        before = (await stats(prefill)).num_prompt_tokens_computed
        assert await ask(PROMPTS[0]) == want[0]
        assert (await stats(prefill)).num_prompt_tokens_computed == before + 9  # pulled
        stores[1].kill()
        assert await ask(PROMPTS[1]) == want[1]
        computed = (await stats(prefill)).num_prompt_tokens_computed
        assert computed == before + 9 + len(PROMPTS[1])  # all of it
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "nothing held")

    asyncio.run(run())
    assert metric(router, "pdserve_routing_decisions_total", 'reason="store"') >= 1
