"""The contract every prefix-index backend passes, against a real Redis server for the Redis
backend: lookups return exactly the leading blocks each worker's cache holds."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable

import pytest

from engine.block_hash import hash_blocks, root_hash
from engine.kv_events import CacheTier, KVEvents
from engine.sampling_params import SamplingParams
from native_engine.block_manager import BlockManager
from native_engine.paged_sequence import PagedSequence
from pdserve.cluster.prefix_index import ANY_TIER, InMemoryPrefixIndex, PrefixHits, PrefixIndex
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex

BS = 4
ROOT = root_hash("index-test")
H = hash_blocks(ROOT, list(range(6 * BS)), BS)  # six chained block hashes


@pytest.fixture(params=["memory", "redis"])
def make_index(request: pytest.FixtureRequest) -> Callable[[], PrefixIndex]:
    if request.param == "memory":
        return InMemoryPrefixIndex
    url = request.getfixturevalue("redis_url")
    # A fresh namespace per test: no state leaks between tests sharing the server.
    return lambda: RedisPrefixIndex.from_url(url, namespace=f"test-{uuid.uuid4().hex[:8]}")


def _run(
    make_index: Callable[[], PrefixIndex], body: Callable[[PrefixIndex], Awaitable[None]]
) -> None:
    async def main() -> None:
        index = make_index()
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(main())


def test_lookup_counts_leading_blocks_per_worker(make_index: Callable[[], PrefixIndex]) -> None:
    async def body(index: PrefixIndex) -> None:
        await index.apply("a", KVEvents(stored=H, removed=[]))
        await index.apply("b", KVEvents(stored=[H[0], H[1], H[2], H[4]], removed=[]))
        assert await index.longest_prefixes(H, ["a", "b", "c"]) == {"a": 6, "b": 3, "c": 0}
        assert await index.longest_prefixes(H[:2], ["b"]) == {"b": 2}
        assert await index.longest_prefixes([], ["a"]) == {"a": 0}
        assert await index.longest_prefixes(H, []) == {}

    _run(make_index, body)


def test_host_tier_blocks_extend_a_prefix_only_when_asked(
    make_index: Callable[[], PrefixIndex],
) -> None:
    """A worker holding H0..H1 on its device and H2..H4 in its host tier: device-only lookups
    see 2 blocks, lookups over both tiers see 5; tiers are replaced and removed apart."""
    host = CacheTier.HOST

    async def body(index: PrefixIndex) -> None:
        await index.apply("a", KVEvents(stored=H[:2], removed=[]))
        await index.apply("a", KVEvents(stored=H[2:5], removed=[], tier=host))
        await index.apply("b", KVEvents(stored=H[1:4], removed=[], tier=host))  # no H0: useless
        assert await index.longest_prefixes(H, ["a", "b"]) == {"a": 2, "b": 0}
        assert await index.longest_prefixes(H, ["a", "b"], ANY_TIER) == {"a": 5, "b": 0}
        assert await index.longest_prefixes(H, ["b"], (host,)) == {"b": 0}
        await index.apply("a", KVEvents(stored=[], removed=[H[3]], tier=host))
        assert await index.longest_prefixes(H, ["a"], ANY_TIER) == {"a": 3}
        hits = await index.prefix_hits(H, ["a", "b", "c"])  # both lookups in one
        assert hits == {"a": PrefixHits(2, 3), "b": PrefixHits(0, 0), "c": PrefixHits(0, 0)}
        assert await index.prefix_hits([], ["a"]) == {"a": PrefixHits(0, 0)}
        assert await index.prefix_hits(H, []) == {}
        await index.replace("a", [H[0]], host)  # the device tier is untouched
        assert await index.longest_prefixes(H, ["a"], ANY_TIER) == {"a": 2}
        await index.remove_worker("a")
        assert await index.longest_prefixes(H, ["a"], ANY_TIER) == {"a": 0}

    _run(make_index, body)


def test_evictions_clears_snapshots_and_worker_removal(
    make_index: Callable[[], PrefixIndex],
) -> None:
    async def body(index: PrefixIndex) -> None:
        await index.apply("a", KVEvents(stored=H, removed=[]))
        await index.apply("a", KVEvents(stored=[], removed=[H[3]]))
        assert await index.longest_prefixes(H, ["a"]) == {"a": 3}  # stops at the hole
        await index.apply("a", KVEvents(stored=[H[0]], removed=[], cleared=True))
        assert await index.longest_prefixes(H, ["a"]) == {"a": 1}
        await index.replace("a", H[:5])
        assert await index.longest_prefixes(H, ["a"]) == {"a": 5}
        await index.remove_worker("a")
        assert await index.longest_prefixes(H, ["a"]) == {"a": 0}

    _run(make_index, body)


def test_index_tracks_a_real_block_manager_exactly(make_index: Callable[[], PrefixIndex]) -> None:
    """Random admissions, frees and evictions on two workers' block managers; after every batch
    of events the index answers exactly what each manager's own prefix lookup finds."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    managers = {"w0": BlockManager(12, BS, True), "w1": BlockManager(12, BS, True)}

    async def body(index: PrefixIndex) -> None:
        num_hits = 0
        for step in range(40):
            worker = rng.choice(list(managers))
            bm = managers[worker]
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(6))]
            seq = PagedSequence(f"r{step}", tokens, SamplingParams())
            seq.update_block_hashes(ROOT, BS)
            hits = bm.cached_prefix(seq)
            if bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits):
                seq.num_computed_tokens = seq.num_tokens
                bm.register_computed_blocks(seq)
                bm.free(seq)
            await index.apply(worker, bm.kv_events.drain())
            probe = hash_blocks(ROOT, rng.choice(prefixes) + [0] * BS, BS)
            expected = {
                w: len(m.find_cached_prefix(probe, len(probe))) for w, m in managers.items()
            }
            assert await index.longest_prefixes(probe, list(managers)) == expected
            num_hits += sum(expected.values())
        # The walk really exercised both hits and evictions.
        assert num_hits > 0
        assert all(m.num_evicted_blocks > 0 for m in managers.values())
        # A worker dies: its entries go with it.
        await index.remove_worker("w0")
        probe = hash_blocks(ROOT, prefixes[0], BS)
        assert (await index.longest_prefixes(probe, ["w0"]))["w0"] == 0

    _run(make_index, body)


def test_prefix_hits_are_both_lookups(make_index: Callable[[], PrefixIndex]) -> None:
    """Random device and host sets (holes included): ``prefix_hits`` is exactly the device-only
    and the both-tiers ``longest_prefixes``, for every worker."""
    rng = random.Random(5)
    hashes = hash_blocks(ROOT, list(range(12 * BS)), BS)
    workers = [f"w{i}" for i in range(8)]

    async def body(index: PrefixIndex) -> None:
        for w in workers:
            for tier in CacheTier:
                held = [h for h in hashes if rng.random() < 0.7]
                await index.apply(w, KVEvents(stored=held, removed=[], tier=tier))
        for n in (1, 5, 12):
            device = await index.longest_prefixes(hashes[:n], workers)
            either = await index.longest_prefixes(hashes[:n], workers, ANY_TIER)
            expected = {w: PrefixHits(device[w], either[w]) for w in workers}
            assert await index.prefix_hits(hashes[:n], workers) == expected
        assert any(e.num_any_tier_blocks > e.num_device_blocks for e in expected.values())

    _run(make_index, body)
