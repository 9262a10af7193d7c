"""The host tier's pure core: LRU slots by block hash, its KV events, and the scheduler's
loading state (exact values)."""

from __future__ import annotations

import pytest

from engine.block_hash import root_hash
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from native_engine.block_manager import BlockManager
from native_engine.host_index import HostIndex
from native_engine.paged_sequence import PagedSequence
from native_engine.scheduler import Scheduler

ROOT = root_hash("test-model/float32/bs4")


def test_slots_are_lru_by_hash_and_events_name_the_tier_changes() -> None:
    index = HostIndex(2)
    a, b, c = (root_hash(x) for x in "abc")
    assert index.reserve(a) == 0 and index.reserve(b) == 1
    assert index.reserve(a) is None  # held: touched, not copied again
    assert index.lookup([a, b, c]) == [0, 1]  # a run from the start, as far as held
    assert index.lookup([c, a]) == []
    index.lookup([a])  # a most recent: b is out first
    assert index.reserve(c) == 1 and b not in index and index.num_evicted == 1
    events = index.kv_events.drain()
    assert set(events.stored) == {a, c} and events.removed == [b]
    with pytest.raises(ValueError, match="slot"):
        HostIndex(0)


def _seq(request_id: str, tokens: list[int]) -> PagedSequence:
    seq = PagedSequence(request_id, tokens, SamplingParams())
    seq.update_block_hashes(ROOT, 4)
    return seq


def test_a_host_hit_is_admitted_into_loading_then_takes_a_seat() -> None:
    index = HostIndex(8)
    bm = BlockManager(16, 4, enable_prefix_caching=True, host_index=index)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    seq = _seq("r", list(range(13)))  # 3 full blocks + 1 token
    for block_hash in seq.block_hashes[:2]:
        index.reserve(block_hash)  # slots 0, 1 hold the first two blocks
    scheduler.add(seq)
    out = scheduler.schedule()
    assert not out.scheduled and scheduler.loading == [seq]
    assert out.loads == [(seq, [(0, 0), (1, 1)])]
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.num_host_cached_tokens) == (
        8, 8, 8
    )  # fmt: skip
    scheduler.loaded(seq)
    out = scheduler.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(seq, 5)]
    seq.num_computed_tokens = 13
    bm.register_computed_blocks(seq)
    scheduler.remove(seq)
    bm.free(seq)
    to_store, reused = bm.drain_to_store(), bm.drain_reused()
    # Every full block became cached-free (to store); blocks 0..3 were handed out.
    assert [b.block_id for b in to_store] == [2, 1, 0] and reused == [0, 1, 2, 3]
    bm.check_no_leaks()


def test_without_a_host_tier_nothing_is_tracked() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    seq = _seq("r", list(range(9)))
    assert bm.allocate_slots(seq, 9)
    seq.num_computed_tokens = 9
    bm.register_computed_blocks(seq)
    bm.free(seq)
    assert bm.drain_to_store() == bm.drain_reused() == [] and bm.host_prefix(seq, 0) == []


def test_protected_slots_are_never_evicted() -> None:
    index = HostIndex(2)
    a, b, c, d = (root_hash(x) for x in "abcd")
    index.reserve(a)  # slot 0
    index.reserve(b)  # slot 1
    assert index.reserve(c, protected={0}) == 1 and a in index and b not in index
    assert index.reserve(d, protected={0, 1}) is None and d not in index  # nothing to give
    index.check()
