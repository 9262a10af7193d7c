"""KV events from the block manager: exactly the hashes that entered and left the prefix cache,
in the form the cluster index consumes (last operation per hash wins within a batch)."""

from __future__ import annotations

from engine.block_hash import hash_blocks
from engine.kv_events import KVEventLog
from native_engine.block_manager import BlockManager
from tests.unit.test_block_manager import BS, ROOT, make_seq, prefill, take_one_block


def test_stored_events_are_the_router_side_hashes() -> None:
    bm = BlockManager(8, BS, True)
    tokens = list(range(100, 111))  # 2 full blocks + 3 tokens
    prefill(bm, make_seq("a", tokens))
    events = bm.kv_events.drain()
    # The router hashes the same tokens with the same function and finds the same keys.
    assert events.stored == hash_blocks(ROOT, tokens, BS)
    assert events.removed == [] and not events.cleared
    assert bm.kv_events.drain().empty


def test_eviction_is_reported_and_cancels_a_pending_store() -> None:
    bm = BlockManager(3, BS, True)
    seq = make_seq("a", list(range(8)))  # 2 full blocks
    prefill(bm, seq)
    stored = bm.kv_events.drain().stored
    bm.free(seq)
    # Three fresh allocations reuse the free blocks; the two hashed ones are evicted
    # (the unhashed block first, then LRU order: tail before head).
    take_one_block(bm, "x")
    take_one_block(bm, "yy")
    events = bm.kv_events.drain()
    assert events.stored == [] and events.removed == [stored[1]]
    take_one_block(bm, "zzz")
    assert bm.kv_events.drain().removed == [stored[0]]
    assert bm.cached_hashes() == []


def test_store_then_evict_within_one_batch_nets_to_removed() -> None:
    log = KVEventLog()
    log.stored(b"a" * 16)
    log.stored(b"b" * 16)
    log.removed(b"a" * 16)
    events = log.drain()
    assert (events.stored, events.removed) == ([b"b" * 16], [b"a" * 16])


def test_reset_reports_cleared_and_snapshot_lists_cached_hashes() -> None:
    bm = BlockManager(8, BS, True)
    prefill(bm, make_seq("a", list(range(8))))
    assert bm.cached_hashes() == hash_blocks(ROOT, list(range(8)), BS)
    bm.kv_events.drain()
    bm.reset_prefix_cache()
    events = bm.kv_events.drain()
    assert events.cleared and events.stored == []
    assert bm.cached_hashes() == []
