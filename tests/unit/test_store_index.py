"""The KV store's index (kvstore_service/store_index.py): slots by hash, least recently used
and prefix-aware eviction (a prefix's tail goes before its head), leases pin. Exact values."""

from __future__ import annotations

import pytest

from kvstore_service.store_index import StoreIndex


def h(i: int) -> bytes:
    return bytes([i]) * 16


def chain(index: StoreIndex, first: int, n: int) -> list[int | None]:
    """Admits blocks first..first+n-1, each the parent of the next; their slots."""
    parent, slots = b"", []
    for i in range(first, first + n):
        slots.append(index.admit(h(i), parent))
        parent = h(i)
    return slots


def test_admit_hands_out_free_slots_then_touches_what_it_holds() -> None:
    index = StoreIndex(4)
    assert chain(index, 1, 3) == [0, 1, 2]
    assert index.admit(h(2), h(1)) is None  # held: made most recently used, not stored again
    assert len(index) == 3 and index.num_stored == 3
    index.check()


def test_a_full_store_evicts_the_least_recently_used_leaf_first() -> None:
    index = StoreIndex(4)
    chain(index, 1, 3)  # 1 -> 2 -> 3: only 3 is a leaf
    assert index.admit(h(9), b"") == 3  # a free slot
    # Full. LRU order: 1, 2, 3, 9. 1 and 2 have children; 3 is the oldest leaf.
    assert index.admit(h(10), b"") == 2
    assert h(3) not in index and h(1) in index and h(2) in index
    assert index.num_evicted == 1
    # Now 2 is a leaf (its child went) and the oldest one: it goes next, before 9.
    assert index.admit(h(11), b"") == 1 and h(2) not in index and h(9) in index
    index.check()


def test_run_finds_the_leading_blocks_and_makes_them_recent() -> None:
    index = StoreIndex(6)
    chain(index, 1, 3)
    index.admit(h(7), b"")
    assert index.run([h(1), h(2), h(5), h(3)]) == [h(1), h(2)]  # stops at the first miss
    assert index.run([h(4)]) == []
    # 3 was not touched: of the leaves (3, 7), 3 is the least recently used now.
    index.admit(h(8), b"")
    index.admit(h(9), b"")  # full
    assert index.admit(h(10), b"") == 2 and h(3) not in index  # 3 held slot 2


def test_pinned_blocks_are_never_evicted_and_a_store_of_pins_refuses() -> None:
    index = StoreIndex(2)
    chain(index, 1, 2)  # 1 -> 2
    assert index.pin([h(1), h(2)]) == [0, 1]
    assert index.admit(h(5), b"") is None and index.num_refused == 1 and h(5) not in index
    index.unpin([h(2)])
    assert index.admit(h(5), b"") == 1 and h(2) not in index  # 2: unpinned, a leaf
    # 1 stays pinned (and 5, its slot's new block, is the one unpinned leaf).
    assert index.admit(h(6), b"") == 1 and h(5) not in index and h(1) in index
    index.check()


def test_unpinning_more_than_pinned_is_a_bug() -> None:
    index = StoreIndex(1)
    index.admit(h(1), b"")
    with pytest.raises(AssertionError, match="unpinned more than pinned"):
        index.unpin([h(1)])


def test_kv_events_name_what_came_and_went() -> None:
    index = StoreIndex(1)
    index.admit(h(1), b"")
    index.admit(h(2), b"")
    events = index.kv_events.drain()
    assert events.stored == [h(2)] and events.removed == [h(1)]


def test_a_chain_that_arrives_tail_first_is_still_evicted_tail_first() -> None:
    """Workers evict (and so offload) a prompt's tail first: a child is admitted before its
    parent, and the parent must count it."""
    index = StoreIndex(4)
    for i, parent in ((3, h(2)), (2, h(1)), (1, b"")):  # 1 -> 2 -> 3, tail first
        index.admit(h(i), parent)
    index.check()
    index.admit(h(9), b"")  # full now
    assert index.admit(h(10), b"") == 0 and h(3) not in index  # the tail, not the head
    assert index.admit(h(11), b"") == 1 and h(2) not in index
    assert index.run([h(1)]) == [h(1)]
    index.check()
