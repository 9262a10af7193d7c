"""native_engine/scheduler.py: token budget, admission order, preemption by recompute, dropping.

Each test drives the scheduler the way the engine does: after ``schedule()`` every scheduled
sequence advances ``num_computed_tokens`` by its ``num_new_tokens`` and publishes its full blocks;
a sequence whose step ``completes_sequence`` gets one new token appended (and rehashed).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.block_hash import root_hash
from engine.config import SchedulerConfig, SchedulingPolicy
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from native_engine.block_manager import BlockManager
from native_engine.paged_sequence import PagedSequence
from native_engine.scheduler import Scheduler, SchedulerOutput

BS = 4
ROOT = root_hash("test-model/float32/bs4")


def make_scheduler(
    num_blocks: int,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    return Scheduler(config, BlockManager(num_blocks, BS, enable_prefix_caching))


def make_seq(request_id: str, token_ids: Seq[int]) -> PagedSequence:
    seq = PagedSequence(request_id, list(token_ids), SamplingParams())
    seq.update_block_hashes(ROOT, BS)
    return seq


def prompt(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def advance(sched: Scheduler, out: SchedulerOutput) -> list[str]:
    """What the engine does after running the model on ``out``; returns who sampled a token."""
    sampled: list[str] = []
    for s in out.scheduled:
        seq = s.seq
        completes = s.completes_sequence  # read before num_computed_tokens moves
        seq.num_computed_tokens += s.num_new_tokens
        sched.block_manager.register_computed_blocks(seq)
        if completes:
            seq.token_ids.append(10_000 + seq.num_tokens)
            seq.update_block_hashes(ROOT, BS)
            sampled.append(seq.request_id)
    return sampled


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model."""
    out = sched.schedule()
    advance(sched, out)
    return out


def batch(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def ids(seqs: Seq[PagedSequence]) -> list[str]:
    return [s.request_id for s in seqs]


def finish(sched: Scheduler, seq: PagedSequence) -> None:
    seq.status = SequenceStatus.FINISHED_STOPPED
    sched.remove(seq)
    sched.block_manager.free(seq)


# ---- token budget -------------------------------------------------------------------------


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = make_scheduler(32, max_num_batched_tokens=16)
    a = make_seq("a", prompt(0, 40))
    sched.add(a)
    assert sched.has_work

    out = sched.schedule()
    assert batch(out) == [("a", 16)]
    assert out.num_batched_tokens == 16
    assert not out.scheduled[0].completes_sequence
    assert a.status is SequenceStatus.RUNNING
    assert a.block_table == [0, 1, 2, 3]
    assert a.num_cached_tokens == 0
    a.num_computed_tokens += 16
    assert sched.block_manager.register_computed_blocks(a) == a.block_hashes[:4]

    out = sched.schedule()
    assert batch(out) == [("a", 16)]
    assert advance(sched, out) == []
    assert a.num_computed_tokens == 32
    assert a.block_table == list(range(8))

    out = sched.schedule()
    assert batch(out) == [("a", 8)]
    assert out.scheduled[0].completes_sequence
    assert advance(sched, out) == ["a"]
    assert a.num_computed_tokens == 40
    assert a.num_tokens == 41
    assert a.block_table == list(range(10))

    out = sched.schedule()  # decode: token 41 needs block 10
    assert batch(out) == [("a", 1)]
    assert advance(sched, out) == ["a"]
    assert a.block_table == list(range(11))
    assert sched.block_manager.num_free_blocks == 21
    assert sched.block_manager.num_cached_blocks == 10
    assert out.preempted == []
    assert out.dropped == []


def test_running_sequences_take_the_budget_before_waiting_ones() -> None:
    sched = make_scheduler(32, max_num_batched_tokens=16)
    a = make_seq("a", prompt(0, 40))
    b = make_seq("b", prompt(100, 10))
    sched.add(a)
    sched.add(b)
    trace = [batch(step(sched)) for _ in range(5)]
    assert trace == [
        [("a", 16)],
        [("a", 16)],
        [("a", 8), ("b", 8)],
        [("a", 1), ("b", 2)],
        [("a", 1), ("b", 1)],
    ]
    assert a.block_table == [*range(10), 12]
    assert b.block_table == [10, 11, 13]
    assert (a.num_tokens, a.num_computed_tokens) == (43, 42)
    assert (b.num_tokens, b.num_computed_tokens) == (12, 11)


def test_a_later_arrival_is_scheduled_after_running_decodes() -> None:
    sched = make_scheduler(16, max_num_batched_tokens=6)
    a = make_seq("a", prompt(0, 4))
    sched.add(a)
    assert batch(step(sched)) == [("a", 4)]
    b = make_seq("b", prompt(100, 10))
    sched.add(b)
    assert batch(step(sched)) == [("a", 1), ("b", 5)]
    assert batch(step(sched)) == [("a", 1), ("b", 5)]
    assert batch(step(sched)) == [("a", 1), ("b", 1)]
    assert ids(sched.running) == ["a", "b"]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(16, max_num_seqs=2)
    a, b, c = (make_seq(n, prompt(100 * i, 4)) for i, n in enumerate("abc"))
    for seq in (a, b, c):
        sched.add(seq)
    out = step(sched)
    assert batch(out) == [("a", 4), ("b", 4)]
    assert ids(sched.running) == ["a", "b"]
    assert ids(sched.waiting) == ["c"]
    assert c.status is SequenceStatus.WAITING
    assert batch(step(sched)) == [("a", 1), ("b", 1)]
    finish(sched, a)
    assert batch(step(sched)) == [("b", 1), ("c", 4)]
    assert ids(sched.running) == ["b", "c"]
    # a freed [0 (full, cached), 2 (partial, unhashed)]: the unhashed one is reused first.
    assert c.block_table == [2]


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    sched = make_scheduler(4)
    a = make_seq("a", prompt(0, 12))
    b = make_seq("b", prompt(100, 8))
    c = make_seq("c", prompt(200, 2))
    for seq in (a, b, c):
        sched.add(seq)
    out = step(sched)
    assert batch(out) == [("a", 12)]
    assert ids(sched.waiting) == ["b", "c"]  # c would fit in the last block but must not jump b
    assert sched.block_manager.num_free_blocks == 1
    assert b.block_table == [] and c.block_table == []
    assert out.dropped == [] and out.preempted == []
    assert b.status is SequenceStatus.WAITING
    assert b.num_cached_tokens == -1
    # a's decode takes the last block; b still waits at the head.
    assert batch(step(sched)) == [("a", 1)]
    assert a.block_table == [0, 1, 2, 3]
    assert ids(sched.waiting) == ["b", "c"]
    finish(sched, a)
    out = step(sched)
    assert batch(out) == [("b", 8), ("c", 2)]
    assert b.block_table == [3, 2]
    assert c.block_table == [1]


# ---- preemption ---------------------------------------------------------------------------


def test_decode_without_a_free_block_preempts_the_last_admitted() -> None:
    sched = make_scheduler(4)
    bm = sched.block_manager
    a = make_seq("a", prompt(0, 8))
    b = make_seq("b", prompt(100, 7))
    sched.add(a)
    sched.add(b)
    assert batch(step(sched)) == [("a", 8), ("b", 7)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert bm.num_free_blocks == 0
    # a's ninth token needs a third block; b (admitted last) is preempted by recompute.
    out = step(sched)
    assert batch(out) == [("a", 1)]
    assert out.preempted == [b]
    assert out.dropped == []
    assert sched.num_preemptions == 1
    assert ids(sched.running) == ["a"]
    assert ids(sched.waiting) == ["b"]
    assert b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.block_table == []
    assert b.num_registered_blocks == 0
    assert b.num_tokens == 8  # prompt + its first output, recomputed later
    assert a.block_table == [0, 1, 3]  # b's unhashed partial block
    assert bm.num_free_blocks == 1
    assert bm.find_cached_prefix(b.block_hashes, 2) == [2]  # b's full block stays cached


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(5, max_num_batched_tokens=8, enable_prefix_caching=False)
    bm = sched.block_manager
    a = make_seq("a", prompt(0, 5))
    c = make_seq("c", prompt(100, 8))
    sched.add(a)
    sched.add(c)
    assert batch(step(sched)) == [("a", 5), ("c", 3)]
    assert batch(step(sched)) == [("a", 1), ("c", 5)]
    assert batch(step(sched)) == [("a", 1), ("c", 1)]
    assert batch(step(sched)) == [("a", 1), ("c", 1)]
    assert (a.block_table, c.block_table) == ([0, 1], [2, 3, 4])
    assert bm.num_free_blocks == 0
    assert (a.num_tokens, a.num_computed_tokens) == (9, 8)
    d = make_seq("d", prompt(200, 1))
    sched.add(d)

    out = step(sched)  # a needs block 3 of its own: c is preempted, 2 blocks stay free
    assert batch(out) == [("a", 1)]
    assert out.preempted == [c]
    assert ids(sched.waiting) == ["c", "d"]
    assert bm.num_free_blocks == 2
    assert sched.num_preemptions == 1
    assert c.num_tokens == 11

    # Next step the preempted sequence is readmitted first (chunked: 7 of its 11 tokens).
    out = step(sched)
    assert batch(out) == [("a", 1), ("c", 7)]
    assert out.preempted == []
    assert ids(sched.waiting) == ["d"]
    assert c.num_computed_tokens == 7


def test_preempted_sequence_is_recomputed_from_the_prefix_cache() -> None:
    sched = make_scheduler(5)
    bm = sched.block_manager
    a = make_seq("a", prompt(0, 8))
    b = make_seq("b", prompt(100, 8))
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert batch(out) == [("a", 8), ("b", 8)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert b.num_cached_tokens == 0
    assert bm.num_cached_blocks == 4

    out = step(sched)  # a takes the last block; b, the last admitted, preempts itself
    assert batch(out) == [("a", 1)]
    assert out.preempted == [b]
    assert sched.num_preemptions == 1
    assert a.block_table == [0, 1, 4]
    assert b.block_table == []
    assert (b.num_tokens, b.num_computed_tokens) == (9, 0)
    assert bm.num_free_blocks == 2
    assert bm.find_cached_prefix(b.block_hashes, 2) == [2, 3]

    # b's two hits are the only free blocks, and it needs one more: it keeps waiting.
    out = step(sched)
    assert batch(out) == [("a", 1)]
    assert out.preempted == []
    assert ids(sched.waiting) == ["b"]
    assert b.status is SequenceStatus.WAITING

    finish(sched, a)
    out = sched.schedule()
    assert batch(out) == [("b", 1)]
    assert b.block_table == [2, 3, 4]
    assert b.num_computed_tokens == 8
    assert b.num_cached_tokens == 0  # set once, at first admission
    assert out.scheduled[0].completes_sequence
    assert bm.num_evicted_blocks == 0
    assert sched.num_preemptions == 1


def test_unaligned_prefill_chunks_are_fully_published_to_the_prefix_cache() -> None:
    """A decode in the batch makes the prefill chunks end mid-block; every full block of the
    prompt must still be published so that the same prompt hits all of them."""
    sched = make_scheduler(16, max_num_batched_tokens=8)
    bm = sched.block_manager
    a = make_seq("a", prompt(0, 4))
    sched.add(a)
    assert batch(step(sched)) == [("a", 4)]
    b = make_seq("b", prompt(100, 16))
    sched.add(b)
    assert batch(step(sched)) == [("a", 1), ("b", 7)]
    assert batch(step(sched)) == [("a", 1), ("b", 7)]
    assert batch(step(sched)) == [("a", 1), ("b", 2)]
    assert b.num_computed_tokens == 16
    assert bm.find_cached_prefix(b.block_hashes, 4) == b.block_table[:4]
    c = make_seq("c", [*prompt(100, 16), 7])
    sched.add(c)
    out = sched.schedule()
    assert batch(out) == [("a", 1), ("b", 1), ("c", 1)]
    assert c.num_cached_tokens == 16


def test_sequence_that_can_never_fit_is_dropped_at_admission() -> None:
    sched = make_scheduler(4)
    big = make_seq("big", prompt(0, 17))  # 5 blocks > 4 in the cache
    small = make_seq("small", prompt(100, 3))
    sched.add(big)
    sched.add(small)
    out = step(sched)
    assert out.dropped == [big]
    assert big.status is SequenceStatus.FINISHED_LENGTH
    assert big.block_table == []
    assert batch(out) == [("small", 3)]
    assert ids(sched.running) == ["small"]
    assert list(sched.waiting) == []
    assert sched.num_preemptions == 0


def test_running_sequence_outgrowing_the_cache_is_dropped() -> None:
    sched = make_scheduler(4, max_num_batched_tokens=8)
    bm = sched.block_manager
    a = make_seq("a", prompt(0, 15))
    sched.add(a)
    assert batch(step(sched)) == [("a", 8)]
    assert batch(step(sched)) == [("a", 7)]
    assert batch(step(sched)) == [("a", 1)]
    assert a.block_table == [0, 1, 2, 3]
    assert (a.num_tokens, a.num_computed_tokens) == (17, 16)
    out = step(sched)  # token 17 needs a fifth block: it never will
    assert out.dropped == [a]
    assert out.preempted == []
    assert batch(out) == []
    assert out.is_empty
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert sched.num_preemptions == 0
    assert not sched.has_work
    assert a.block_table == []
    bm.check_no_leaks()
    assert step(sched).is_empty


def test_prompt_longer_than_the_cache_is_dropped_mid_prefill() -> None:
    sched = make_scheduler(4, max_num_batched_tokens=8)
    a = make_seq("a", prompt(0, 20))
    sched.add(a)
    assert batch(step(sched)) == [("a", 8)]
    assert batch(step(sched)) == [("a", 8)]
    out = step(sched)
    assert out.dropped == [a]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert not sched.has_work
    sched.block_manager.check_no_leaks()


# ---- prefix cache -------------------------------------------------------------------------


def test_prefix_hit_sets_num_cached_tokens_at_admission() -> None:
    sched = make_scheduler(16)
    bm = sched.block_manager
    a = make_seq("a", prompt(0, 9))
    sched.add(a)
    assert batch(step(sched)) == [("a", 9)]
    finish(sched, a)
    b = make_seq("b", [*prompt(0, 8), 500, 501])
    c = make_seq("c", prompt(0, 8))
    d = make_seq("d", prompt(300, 8))
    for seq in (b, c, d):
        sched.add(seq)
    out = sched.schedule()
    assert batch(out) == [("b", 2), ("c", 4), ("d", 8)]
    assert [s.completes_sequence for s in out.scheduled] == [True, True, True]
    assert b.num_cached_tokens == 8
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == [0, 1]
    assert c.num_cached_tokens == 4  # two full blocks, but the last token is always computed
    assert c.block_table[0] == 0
    assert d.num_cached_tokens == 0
    assert bm.num_evicted_blocks == 0


def test_prefix_caching_disabled_never_hits() -> None:
    sched = make_scheduler(16, enable_prefix_caching=False)
    a = make_seq("a", prompt(0, 9))
    sched.add(a)
    step(sched)
    finish(sched, a)
    b = make_seq("b", prompt(0, 9))
    sched.add(b)
    assert batch(step(sched)) == [("b", 9)]
    assert b.num_cached_tokens == 0


# ---- bookkeeping --------------------------------------------------------------------------


def test_remove_running_and_waiting() -> None:
    sched = make_scheduler(16, max_num_seqs=1)
    a = make_seq("a", prompt(0, 4))
    b = make_seq("b", prompt(100, 4))
    sched.add(a)
    sched.add(b)
    step(sched)
    assert ids(sched.running) == ["a"]
    assert ids(sched.waiting) == ["b"]
    sched.remove(b)
    assert list(sched.waiting) == []
    assert ids(sched.running) == ["a"]
    sched.remove(a)
    assert sched.running == []
    assert not sched.has_work
    sched.remove(a)  # unknown: no-op
    assert step(sched).is_empty
    # The caller owns the blocks of a removed sequence.
    assert sched.block_manager.num_free_blocks == 15
    sched.block_manager.free(a)
    sched.block_manager.check_no_leaks()


def _imported(sched: Scheduler, request_id: str, base: int) -> PagedSequence:
    """A sequence whose 6-token prompt KV arrived from elsewhere, with its first token."""
    seq = make_seq(request_id, prompt(base, 6))
    assert sched.block_manager.allocate_slots(seq, 6)
    seq.num_computed_tokens = 6
    seq.token_ids.append(77)
    sched.add_ready(seq)
    return seq


def test_add_ready_joins_the_decode_batch() -> None:
    sched = make_scheduler(16)
    a = _imported(sched, "a", 0)
    assert a.status is SequenceStatus.RUNNING
    out = step(sched)
    assert batch(out) == [("a", 1)]
    assert out.scheduled[0].completes_sequence
    assert a.block_table == [0, 1]


def test_imported_sequences_wait_for_a_seat() -> None:
    """max_num_seqs holds for KV that arrived from a prefill worker too."""
    sched = make_scheduler(64, max_num_seqs=2)
    seqs = [_imported(sched, r, 10 * i) for i, r in enumerate("abcd")]
    assert batch(step(sched)) == [("a", 1), ("b", 1)]
    assert [s.request_id for s in sched.ready] == ["c", "d"]
    sched.remove(seqs[0])  # a finished: c takes its seat, d still waits
    sched.block_manager.free(seqs[0])
    assert batch(step(sched)) == [("b", 1), ("c", 1)]
    assert [s.request_id for s in sched.ready] == ["d"]


def test_ready_sequences_take_seats_before_waiting_ones() -> None:
    sched = make_scheduler(64, max_num_seqs=2)
    sched.add(make_seq("w", prompt(100, 5)))
    _imported(sched, "a", 0)
    _imported(sched, "b", 10)
    assert batch(step(sched)) == [("a", 1), ("b", 1)]
    assert [s.request_id for s in sched.waiting] == ["w"]


def test_a_paused_sequence_keeps_its_blocks_and_gives_up_its_seat() -> None:
    sched = make_scheduler(64, max_num_seqs=1)
    a = _imported(sched, "a", 0)
    b = _imported(sched, "b", 10)
    assert batch(step(sched)) == [("a", 1)]
    blocks = list(a.block_table)
    assert sched.pause(a)
    assert sched.pause(a)  # already paused
    assert batch(step(sched)) == [("b", 1)]  # b takes the seat a gave up
    assert a.block_table == blocks and a not in sched.running
    sched.resume(a)
    assert [s.request_id for s in sched.ready] == ["a"]
    sched.remove(b)
    sched.block_manager.free(b)
    assert batch(step(sched)) == [("a", 1)]
    waiting = make_seq("w", prompt(50, 3))
    sched.add(waiting)
    assert not sched.pause(waiting)  # no seat to give up
    sched.remove(a)
    sched.remove(waiting)
    sched.block_manager.free(a)
    sched.block_manager.check_no_leaks()


def test_empty_queue_schedules_nothing() -> None:
    sched = make_scheduler(4)
    out = sched.schedule()
    assert out.is_empty
    assert out.num_batched_tokens == 0
    assert not sched.has_work


def test_a_running_sequence_short_of_blocks_takes_them_from_seatless_ready_ones() -> None:
    """Imported KV waiting for a seat holds blocks: when the one running sequence needs a
    block, the newest ready sequence gives its blocks back (recomputed later), instead of the
    running one preempting itself while every seat waits on blocks the ready ones hold."""
    sched = make_scheduler(6, max_num_seqs=1)
    a, b, c = (_imported(sched, r, 10 * i) for i, r in enumerate("abc"))
    assert sched.block_manager.num_free_blocks == 0
    assert batch(step(sched)) == [("a", 1)]  # position 6 of 8 in a's two blocks
    assert batch(step(sched)) == [("a", 1)]  # position 7
    out = step(sched)  # position 8: a third block, from c (the newest ready)
    assert batch(out) == [("a", 1)] and out.preempted == [c]
    assert ids(sched.ready) == ["b"] and ids(sched.waiting) == ["c"]
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_tokens == 7
    # Everyone finishes (each after 12 tokens), one seat at a time: no livelock, no leak.
    finished: list[str] = []
    for _ in range(200):
        out = sched.schedule()
        for name in advance(sched, out):
            seq = next(s for s in (a, b, c) if s.request_id == name)
            if seq.num_tokens >= 12:
                finish(sched, seq)
                finished.append(name)
        if not sched.has_work:
            break
    assert sorted(finished) == ["a", "b", "c"]
    sched.block_manager.check_no_leaks()
    assert sched.block_manager.num_used_blocks == 0


def _paused_scheduler(num_blocks: int, **bounds: float) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, **bounds)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, BS, True))


def test_a_paused_sequence_gives_its_blocks_back_before_a_reading_one_is_preempted() -> None:
    sched = _paused_scheduler(4)
    slow = _imported(sched, "slow", 0)  # 2 blocks of 4: the prompt's 6 tokens, then 2 more
    fast = _imported(sched, "fast", 10)
    step(sched)
    assert sched.pause(slow, now=0.0)
    for _ in range(2):  # fast fills its last block, then needs a new one: none is free
        out = step(sched)
    assert ids(out.preempted) == ["slow"] and batch(out) == [("fast", 1)]
    assert slow.block_table == [] and slow.num_computed_tokens == 0  # given back, recomputed
    assert ids(sched.paused) == ["slow"] and fast in sched.running  # still paused, fast runs
    sched.resume(slow)
    assert ids(sched.waiting) == ["slow"]  # to be recomputed, first in line


def test_past_max_paused_requests_the_oldest_pauses_give_their_blocks_back() -> None:
    sched = _paused_scheduler(64, max_paused_requests=1)
    a, b = _imported(sched, "a", 0), _imported(sched, "b", 10)
    step(sched)
    assert sched.pause(a, now=1.0) and sched.pause(b, now=2.0)
    out = sched.schedule(now=3.0)
    assert ids(out.released) == ["a"] and out.preempted == []
    assert a.block_table == [] and b.block_table != []
    sched.resume(b)
    assert ids(sched.ready) == ["b"]  # with its blocks: for a seat


def test_past_max_pause_s_a_pause_gives_its_blocks_back() -> None:
    sched = _paused_scheduler(64, max_pause_s=10.0)
    a = _imported(sched, "a", 0)
    step(sched)
    assert sched.pause(a, now=100.0)
    assert sched.schedule(now=109.9).released == []
    assert ids(sched.schedule(now=110.0).released) == ["a"]
    assert a.block_table == [] and ids(sched.paused) == ["a"]
    assert sched.schedule(now=200.0).released == []  # once
    sched.remove(a)
    sched.block_manager.check_no_leaks()


# ---- the priority policy (native_engine/wait_order.py) ------------------------------------


def _priority_scheduler(num_blocks: int, **kwargs: object) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=kwargs.pop("max_num_seqs", 8),  # type: ignore[arg-type]
        max_num_batched_tokens=64,
        scheduling_policy=SchedulingPolicy.PRIORITY,
        priority_aging_s=10.0,
    )
    return Scheduler(config, BlockManager(num_blocks, BS, True))


def _urgent(request_id: str, token_ids: Seq[int], priority: int) -> PagedSequence:
    seq = PagedSequence(request_id, list(token_ids), SamplingParams(priority=priority))
    seq.update_block_hashes(ROOT, BS)
    return seq


def test_priority_admits_the_most_urgent_waiting_first_then_by_arrival() -> None:
    sched = _priority_scheduler(64, max_num_seqs=2)
    for i, (rid, priority) in enumerate((("l1", 5), ("l2", 5), ("h1", -1), ("m", 0), ("h2", -1))):
        sched.add(_urgent(rid, prompt(100 * i, 4), priority))
    assert batch(step(sched)) == [("h1", 4), ("h2", 4)]
    assert ids(sched.waiting) == ["m", "l1", "l2"]


def test_fcfs_keeps_arrival_order_whatever_the_priority() -> None:
    sched = make_scheduler(64, max_num_seqs=2)
    for i, (rid, priority) in enumerate((("l1", 5), ("h1", -1), ("l2", 5))):
        sched.add(_urgent(rid, prompt(100 * i, 4), priority))
    assert batch(step(sched)) == [("l1", 4), ("h1", 4)]


def test_priority_preempts_the_least_urgent_under_kv_pressure() -> None:
    sched = _priority_scheduler(4)
    low = _urgent("low", prompt(0, 7), 5)  # admitted first: fcfs would keep it
    high = _urgent("high", prompt(100, 8), -1)
    sched.add(low)
    sched.add(high)
    assert batch(step(sched)) == [("high", 8), ("low", 7)]
    assert sched.block_manager.num_free_blocks == 0
    # high's ninth token needs a third block: low gives its blocks back, though it came first.
    out = step(sched)
    assert out.preempted == [low] and batch(out) == [("high", 1)]
    assert ids(sched.running) == ["high"] and ids(sched.waiting) == ["low"]
    assert low.status is SequenceStatus.WAITING and low.block_table == []


def test_a_waiting_request_ages_past_a_stream_of_more_urgent_ones() -> None:
    sched = _priority_scheduler(64, max_num_seqs=1)
    old = _urgent("old", prompt(0, 4), 1)
    sched.add(old)
    blocker = _urgent("run", prompt(50, 4), -5)
    sched.add(blocker)
    assert batch(sched.schedule(now=0.0)) == [("run", 4)]  # old starts waiting at 0
    finish(sched, blocker)
    sched.add(_urgent("new", prompt(90, 4), 0))
    # At 10 s old has aged one level (1 -> 0): equal to new, and older: it goes first.
    assert batch(sched.schedule(now=10.0)) == [("old", 4)]
    assert ids(sched.waiting) == ["new"]
