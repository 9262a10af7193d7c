"""native_engine/block_manager.py: exact block ids, free counts, ref counts, prefix cache and LRU
order."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest

from engine.block_hash import BlockHash, root_hash
from engine.sampling_params import SamplingParams
from native_engine.block_manager import BlockManager
from native_engine.paged_sequence import PagedSequence

BS = 4
ROOT = root_hash("test-model/float32/bs4")


def make_seq(request_id: str, token_ids: Seq[int]) -> PagedSequence:
    seq = PagedSequence(request_id, list(token_ids), SamplingParams())
    seq.update_block_hashes(ROOT, BS)
    return seq


def prefill(
    bm: BlockManager, seq: PagedSequence, cached_block_ids: Seq[int] = ()
) -> list[BlockHash]:
    """Allocate, 'compute' every remaining token and publish the full blocks."""
    num_new = seq.num_tokens - seq.num_computed_tokens - len(cached_block_ids) * bm.block_size
    assert bm.allocate_slots(seq, num_new, cached_block_ids)
    seq.num_computed_tokens = seq.num_tokens
    return bm.register_computed_blocks(seq)


def take_one_block(bm: BlockManager, request_id: str) -> int:
    """Allocate a single fresh block for a throwaway sequence; returns its id."""
    seq = make_seq(request_id, [90_000 + len(request_id)])
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 1
    return seq.block_table[0]


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


# ---- construction and queries -------------------------------------------------------------


def test_initial_state() -> None:
    bm = BlockManager(8, BS, True)
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 0
    assert bm.num_evicted_blocks == 0
    assert ref_counts(bm) == [0] * 8
    bm.check_no_leaks()


def test_num_blocks_below_one_raises() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS, True)


@pytest.mark.parametrize(("num_tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed(num_tokens: int, blocks: int) -> None:
    assert BlockManager(8, BS, True).blocks_needed(num_tokens) == blocks


# ---- allocation ---------------------------------------------------------------------------


def test_allocation_hands_out_exact_ids_in_order() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(10))
    b = make_seq("b", range(100, 105))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert a.num_computed_tokens == 0  # the caller advances it once the tokens are computed
    assert bm.num_free_blocks == 5
    assert bm.num_used_blocks == 3
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    assert bm.num_used_blocks == 5
    assert ref_counts(bm) == [1, 1, 1, 1, 1, 0, 0, 0]


def test_decode_fills_the_partial_block_before_taking_a_new_one() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(10))
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 1)  # token 11 fits in block 2
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 11
    assert bm.allocate_slots(a, 1)  # token 12 fills block 2
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.allocate_slots(a, 1)  # token 13 needs block 3
    assert a.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4


def test_chunked_allocation_extends_the_table() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(20))
    assert bm.allocate_slots(a, 6)
    assert a.block_table == [0, 1]
    a.num_computed_tokens = 6
    assert bm.allocate_slots(a, 6)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.allocate_slots(a, 8)
    assert a.block_table == [0, 1, 2, 3, 4]
    assert bm.num_free_blocks == 3


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq("a", range(12))
    b = make_seq("b", range(100, 108))
    assert bm.allocate_slots(a, 12)
    assert a.block_table == [0, 1, 2]
    assert not bm.allocate_slots(b, 8)  # needs 2, 1 free
    assert b.block_table == []
    assert b.num_computed_tokens == 0
    assert bm.num_free_blocks == 1
    assert ref_counts(bm) == [1, 1, 1, 0]
    assert take_one_block(bm, "c") == 3  # the free queue is untouched
    assert bm.num_free_blocks == 0
    assert not bm.allocate_slots(make_seq("d", [1]), 1)
    assert bm.num_free_blocks == 0


def test_failed_allocation_with_cached_hits_revives_nothing() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq("a", range(9))
    assert prefill(bm, a) == a.block_hashes[:2]
    assert a.block_table == [0, 1, 2]
    bm.free(a)  # free queue: [2 (unhashed), 3, 1, 0]
    c = make_seq("c", range(500, 508))
    assert bm.allocate_slots(c, 8)
    assert c.block_table == [2, 3]  # unhashed blocks first: no eviction
    assert bm.num_evicted_blocks == 0
    # b shares a's two cached blocks and needs one more: the two free blocks are exactly the hits,
    # so nothing is left for the new block.
    b = make_seq("b", [*range(8), 77, 78, 79, 80])
    hits = bm.cached_prefix(b)
    assert hits == [0, 1]
    assert not bm.allocate_slots(b, 4, hits)
    assert b.block_table == []
    assert b.num_computed_tokens == 0
    assert b.num_registered_blocks == 0
    assert bm.num_free_blocks == 2
    assert bm.num_cached_blocks == 2
    assert ref_counts(bm) == [0, 0, 1, 1]
    assert bm.find_cached_prefix(a.block_hashes, 2) == [0, 1]


def test_free_returns_every_block() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(10))
    prefill(bm, a)
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert a.block_table == []
    assert a.num_registered_blocks == 0
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert ref_counts(bm) == [0] * 8
    bm.check_no_leaks()


def test_free_twice_on_the_same_sequence_is_a_no_op() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq("a", range(6))
    assert bm.allocate_slots(a, 6)
    bm.free(a)
    bm.free(a)  # the table was emptied: nothing left to drop
    assert bm.num_free_blocks == 4
    bm.check_no_leaks()


def test_double_free_of_a_block_raises() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq("a", range(6))
    assert bm.allocate_slots(a, 6)
    stale_table = list(a.block_table)
    bm.free(a)
    a.block_table = stale_table
    with pytest.raises(RuntimeError, match=r"block 1 freed twice \(request a\)"):
        bm.free(a)
    assert bm.num_free_blocks == 4


def test_shared_block_is_freed_only_by_its_last_reference() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(9))
    prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    b = make_seq("b", [*range(8), 50, 51])
    hits = bm.cached_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, 2, hits)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 4
    bm.free(a)
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert bm.num_free_blocks == 5
    with pytest.raises(AssertionError, match="leaked blocks"):
        bm.check_no_leaks()
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_no_leaks()


# ---- prefix cache -------------------------------------------------------------------------


def test_register_computed_blocks_only_publishes_fully_computed_blocks() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(10))
    assert len(a.block_hashes) == 2
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 3
    assert bm.register_computed_blocks(a) == []
    a.num_computed_tokens = 4
    assert bm.register_computed_blocks(a) == [a.block_hashes[0]]
    assert a.num_registered_blocks == 1
    assert bm.register_computed_blocks(a) == []  # nothing new
    a.num_computed_tokens = 7
    assert bm.register_computed_blocks(a) == []
    a.num_computed_tokens = 10  # block 2 is partial: never published
    assert bm.register_computed_blocks(a) == [a.block_hashes[1]]
    assert a.num_registered_blocks == 2
    assert bm.num_cached_blocks == 2
    assert [b.block_hash for b in bm.blocks[:3]] == [a.block_hashes[0], a.block_hashes[1], None]


def test_decode_that_completes_a_block_publishes_it() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(10))
    assert prefill(bm, a) == a.block_hashes[:2]
    assert a.block_table == [0, 1, 2]
    assert a.num_registered_blocks == 2
    # Decode, one token per step as the engine does: tokens 10 and 11 complete block 2.
    a.token_ids.append(10)
    a.update_block_hashes(ROOT, BS)
    assert bm.allocate_slots(a, 1)
    a.num_computed_tokens = 11
    assert bm.register_computed_blocks(a) == []
    a.token_ids.append(11)
    a.update_block_hashes(ROOT, BS)
    assert len(a.block_hashes) == 3
    assert bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.register_computed_blocks(a) == [a.block_hashes[2]]
    assert a.num_registered_blocks == 3
    assert bm.find_cached_prefix(a.block_hashes, 3) == [0, 1, 2]


def test_unaligned_chunked_prefill_publishes_every_full_block() -> None:
    """A chunk that ends inside a block: that block is published once a later chunk fills it."""
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(12))
    assert bm.allocate_slots(a, 6)
    assert a.block_table == [0, 1]
    a.num_computed_tokens = 6
    assert bm.register_computed_blocks(a) == [a.block_hashes[0]]
    assert a.num_registered_blocks == 1
    assert bm.allocate_slots(a, 6)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.register_computed_blocks(a) == [a.block_hashes[1], a.block_hashes[2]]
    assert a.num_registered_blocks == 3
    assert bm.num_cached_blocks == 3
    assert bm.find_cached_prefix(a.block_hashes, 3) == [0, 1, 2]


def test_register_waits_for_block_hashes() -> None:
    bm = BlockManager(8, BS, True)
    a = PagedSequence("a", list(range(8)), SamplingParams())  # hashes not computed yet
    assert bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    assert bm.register_computed_blocks(a) == []
    assert a.num_registered_blocks == 0
    a.update_block_hashes(ROOT, BS)
    assert bm.register_computed_blocks(a) == a.block_hashes
    assert bm.num_cached_blocks == 2


def test_prefix_hit_after_free_revives_the_block() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(10))
    assert prefill(bm, a) == a.block_hashes[:2]
    assert a.block_table == [0, 1, 2]
    bm.free(a)  # free queue: [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.num_free_blocks == 8
    assert bm.num_cached_blocks == 2
    # Free and cached are not exclusive.
    assert bm.find_cached_prefix(a.block_hashes, 2) == [0, 1]
    assert bm.find_cached_prefix(a.block_hashes, 1) == [0]
    assert bm.find_cached_prefix(a.block_hashes, 0) == []

    b = make_seq("b", [*range(8), 100, 101, 102])
    hits = bm.cached_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, 3, hits)
    assert b.block_table == [0, 1, 2]
    assert b.num_computed_tokens == 8
    assert b.num_registered_blocks == 2
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    assert bm.num_evicted_blocks == 0
    assert bm.num_cached_blocks == 2
    # The revived blocks left the free queue: the next five blocks handed out are 3..7.
    assert [take_one_block(bm, f"x{i}") for i in range(5)] == [3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 0
    assert bm.num_evicted_blocks == 0
    assert bm.find_cached_prefix(a.block_hashes, 2) == [0, 1]


def test_lru_eviction_order() -> None:
    bm = BlockManager(6, BS, True)
    a = make_seq("a", range(8))
    b = make_seq("b", range(100, 110))
    prefill(bm, a)
    prefill(bm, b)
    assert a.block_table == [0, 1]
    assert b.block_table == [2, 3, 4]  # block 4 is partial, so unhashed
    assert bm.num_cached_blocks == 4
    bm.free(a)
    bm.free(b)
    # Expected queue: [4 (unhashed, first), 5 (never used), 1, 0 (a: tail, head), 3, 2 (b)].
    order: list[int] = []
    evicted: list[int] = []
    a_hits: list[list[int]] = []
    for i in range(6):
        order.append(take_one_block(bm, f"x{i}"))
        evicted.append(bm.num_evicted_blocks)
        a_hits.append(bm.find_cached_prefix(a.block_hashes, 2))
    assert order == [4, 5, 1, 0, 3, 2]
    assert evicted == [0, 0, 1, 2, 3, 4]
    assert a_hits == [[0, 1], [0, 1], [0], [], [], []]
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(b.block_hashes, 2) == []
    assert all(block.block_hash is None for block in bm.blocks)


def test_unhashed_block_freed_last_is_still_reused_first() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq("a", range(8))
    prefill(bm, a)
    assert a.block_table == [0, 1]
    c = make_seq("c", [200, 201])
    assert bm.allocate_slots(c, 2)
    assert c.block_table == [2]
    bm.free(a)
    bm.free(c)  # unhashed: jumps ahead of a's cached blocks and of block 3
    assert [take_one_block(bm, f"x{i}") for i in range(4)] == [2, 3, 1, 0]
    assert bm.num_evicted_blocks == 2


def test_least_recently_freed_is_evicted_first() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq("a", range(8))
    b = make_seq("b", range(100, 108))
    prefill(bm, a)
    prefill(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(b)
    bm.free(a)
    assert [take_one_block(bm, f"x{i}") for i in range(4)] == [3, 2, 1, 0]
    assert bm.num_evicted_blocks == 4


def test_a_prefix_hit_refreshes_recency() -> None:
    bm = BlockManager(6, BS, True)
    a = make_seq("a", range(8))
    b = make_seq("b", range(100, 108))
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)  # queue: [4, 5, 1, 0, 3, 2]
    a2 = make_seq("a2", [*range(8), 8])
    hits = bm.cached_prefix(a2)
    assert hits == [0, 1]
    assert bm.allocate_slots(a2, 1, hits)
    assert a2.block_table == [0, 1, 4]
    bm.free(a2)  # queue: [4, 5, 3, 2, 1, 0]
    assert [take_one_block(bm, f"x{i}") for i in range(6)] == [4, 5, 3, 2, 1, 0]


def test_eviction_removes_the_hash_and_allows_recaching() -> None:
    bm = BlockManager(2, BS, True)
    a = make_seq("a", range(8))
    assert prefill(bm, a) == a.block_hashes
    assert a.block_table == [0, 1]
    bm.free(a)  # queue: [1, 0]
    assert bm.num_cached_blocks == 2
    x = make_seq("x", range(100, 108))
    assert bm.cached_prefix(x) == []
    assert bm.allocate_slots(x, 8)
    assert x.block_table == [1, 0]
    assert bm.num_evicted_blocks == 2
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(a.block_hashes, 2) == []
    x.num_computed_tokens = 8
    assert bm.register_computed_blocks(x) == x.block_hashes
    assert bm.find_cached_prefix(x.block_hashes, 2) == [1, 0]
    bm.free(x)  # queue: [0, 1]
    # The same contents as a can be cached again, now in other blocks.
    a2 = make_seq("a2", range(8))
    assert bm.cached_prefix(a2) == []
    assert prefill(bm, a2) == a2.block_hashes == a.block_hashes
    assert a2.block_table == [0, 1]
    assert bm.num_evicted_blocks == 4
    assert bm.find_cached_prefix(a.block_hashes, 2) == [0, 1]
    assert bm.find_cached_prefix(x.block_hashes, 2) == []


def test_duplicate_contents_keep_the_first_block_cached() -> None:
    bm = BlockManager(6, BS, True)
    a = make_seq("a", range(8))
    b = make_seq("b", range(8))
    # Both prefill concurrently: neither sees the other's blocks in the cache.
    assert bm.allocate_slots(a, 8)
    assert bm.allocate_slots(b, 8)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    a.num_computed_tokens = 8
    b.num_computed_tokens = 8
    assert bm.register_computed_blocks(a) == a.block_hashes
    assert bm.register_computed_blocks(b) == []
    assert b.num_registered_blocks == 2
    assert bm.num_cached_blocks == 2
    assert bm.find_cached_prefix(b.block_hashes, 2) == [0, 1]
    assert [blk.block_hash for blk in bm.blocks[:4]] == [*a.block_hashes, None, None]
    bm.free(a)
    bm.free(b)  # b's private copies are unhashed: reused first, no eviction
    assert [take_one_block(bm, f"x{i}") for i in range(4)] == [2, 3, 4, 5]
    assert bm.num_evicted_blocks == 0
    assert bm.find_cached_prefix(a.block_hashes, 2) == [0, 1]


@pytest.mark.parametrize(
    ("prompt_len", "hits"),
    [(3, []), (4, []), (5, [0]), (7, [0]), (8, [0]), (9, [0, 1]), (12, [0, 1])],
)
def test_cached_prefix_leaves_at_least_one_token(prompt_len: int, hits: list[int]) -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(12))
    prefill(bm, a)
    assert bm.num_cached_blocks == 3
    bm.free(a)
    b = make_seq("b", range(prompt_len))
    assert bm.cached_prefix(b) == hits


def test_prompt_of_exactly_two_full_blocks_hits_one_block() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(8))
    prefill(bm, a)
    b = make_seq("b", range(8))
    hits = bm.cached_prefix(b)
    assert hits == [0]
    assert bm.allocate_slots(b, 4, hits)
    assert b.block_table == [0, 2]
    assert b.num_computed_tokens == 4
    assert ref_counts(bm)[:3] == [2, 1, 1]


def test_find_cached_prefix_stops_at_the_first_miss() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq("a", range(12))
    prefill(bm, a)
    other = make_seq("o", [*range(4), 99, 99, 99, 99, *range(8, 12)])
    assert bm.find_cached_prefix(other.block_hashes, 3) == [0]
    assert bm.find_cached_prefix(a.block_hashes, 3) == [0, 1, 2]
    assert bm.find_cached_prefix(a.block_hashes, 10) == [0, 1, 2]


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(6, BS, False)
    a = make_seq("a", range(9))
    assert prefill(bm, a) == []
    assert bm.num_cached_blocks == 0
    assert all(block.block_hash is None for block in bm.blocks)
    b = make_seq("b", range(9))
    assert bm.find_cached_prefix(b.block_hashes, 2) == []
    assert bm.cached_prefix(b) == []
    bm.free(a)
    assert bm.cached_prefix(b) == []
    assert prefill(bm, b) == []
    assert b.block_table == [0, 1, 2]  # unhashed blocks return to the front, head first
    assert bm.num_evicted_blocks == 0


def test_reset_prefix_cache_forgets_every_hash() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq("a", range(8))
    prefill(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(a.block_hashes, 2) == []
    assert all(block.block_hash is None for block in bm.blocks)
    assert [take_one_block(bm, f"x{i}") for i in range(4)] == [2, 3, 1, 0]
    assert bm.num_evicted_blocks == 0


def test_check_no_leaks() -> None:
    bm = BlockManager(4, BS, True)
    bm.check_no_leaks()
    a = make_seq("a", range(5))
    assert bm.allocate_slots(a, 5)
    with pytest.raises(AssertionError, match=r"leaked blocks: 2 referenced \(\[0, 1\]\.\.\.\)"):
        bm.check_no_leaks()
    bm.free(a)
    bm.check_no_leaks()
