"""Continuous batching with chunked prefill under a token budget (pure Python, no torch).

Each step spends at most ``max_num_batched_tokens`` tokens: running sequences first (one decode
token each, or the next chunk of a prompt), then waiting sequences in arrival order (or, with
the ``priority`` policy, by priority: ``native_engine/wait_order.py``) while ``max_num_seqs``
and free blocks allow. When a running sequence cannot get a block, the most recently admitted
running sequence (``priority``: the least urgent) is preempted by recompute: its blocks are
freed and it goes back to the front of the waiting queue (prompt + outputs so far are
recomputed later, mostly from the prefix cache). Sequences holding blocks without a seat
(``ready``) give theirs back first.

Sequences whose KV is already in the cache but that hold no decode seat wait in ``ready``
(imported from a prefill worker, or resumed after a pause) and take free seats first. A paused
sequence (its consumer stopped reading) is neither scheduled nor counted against
``max_num_seqs`` until it is resumed; it keeps its blocks only while it is among the
``max_paused_requests`` newest pauses and younger than ``max_pause_s``, and it is the first to
give them back when blocks run short (before any sequence whose reader reads). One that gave
them back is recomputed when resumed, like a preempted one: a slow reader cannot hold KV.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.sequence import SequenceStatus
from native_engine.block_manager import BlockManager
from native_engine.paged_sequence import PagedSequence
from native_engine.wait_order import WaitOrder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: PagedSequence
    # Tokens run this step: uncomputed ones of ``seq.token_ids``, then ``spec_token_ids``.
    num_new_tokens: int
    # Proposed continuation to verify (speculative decoding; ``native_engine/speculator.py``): every
    # one of these positions samples, and only the agreeing prefix is kept.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def completes_sequence(self) -> bool:
        """After this step every known token is computed, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + len(
            self.spec_token_ids
        )

    @property
    def num_sampled(self) -> int:
        """Rows of this step that sample: the last token's, plus one per proposed token."""
        return 1 + len(self.spec_token_ids) if self.completes_sequence else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[PagedSequence] = field(default_factory=list)
    # Admitted with a host-tier hit: (sequence, [(host slot, device block), ...]) to copy in;
    # the sequence waits in ``loading`` until the engine calls ``loaded``.
    loads: list[tuple[PagedSequence, list[tuple[int, int]]]] = field(default_factory=list)
    # Sequences that can never fit in the cache; finished with reason "length".
    dropped: list[PagedSequence] = field(default_factory=list)
    # Paused sequences past max_paused_requests or max_pause_s: blocks given back, still paused.
    released: list[PagedSequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[PagedSequence] = deque()
        self.running: list[PagedSequence] = []
        self.ready: deque[PagedSequence] = deque()  # KV in the cache, waiting for a seat
        self.paused: list[PagedSequence] = []  # no seat, not scheduled; oldest pause first
        self._paused_at: dict[str, float] = {}  # request id -> when it paused
        self.loading: list[PagedSequence] = []  # blocks being copied in from the host tier
        self.num_preemptions = 0
        # Which sequence goes first, and which yields its blocks (fcfs or priority).
        self.order = WaitOrder(config.scheduling_policy, config.priority_aging_s)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready or self.loading)

    def add(self, seq: PagedSequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.order.arrived(seq)
        self.waiting.append(seq)

    def add_ready(self, seq: PagedSequence) -> None:
        """A sequence whose blocks are allocated and filled (imported KV): it joins the running
        batch when a seat is free, ahead of waiting sequences (it already holds its blocks)."""
        seq.status = SequenceStatus.RUNNING
        self.order.arrived(seq)
        self.ready.append(seq)

    def pause(self, seq: PagedSequence, now: float = 0.0) -> bool:
        """Takes a running (or ready) sequence out of scheduling, keeping its blocks for now
        (``now``: the clock ``schedule`` is given). False when it holds no seat to give up
        (waiting: it produces nothing until admitted anyway)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.ready:
            self.ready.remove(seq)
        else:
            return seq in self.paused
        self.paused.append(seq)
        self._paused_at[seq.request_id] = now
        return True

    def loaded(self, seq: PagedSequence) -> None:
        """Its host-tier blocks are in the device cache: it takes a seat like imported KV."""
        self.loading.remove(seq)
        self.ready.append(seq)

    def resume(self, seq: PagedSequence) -> None:
        """Back to scheduling: with its blocks, for a seat; without (it gave them back), to
        the front of the waiting queue, to be recomputed."""
        if seq in self.paused:
            self.paused.remove(seq)
            del self._paused_at[seq.request_id]
            if seq.block_table:
                self.ready.append(seq)
            else:
                self.waiting.appendleft(seq)

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """One step's batch. ``now``: a monotonic clock reading (for ``max_pause_s``)."""
        out = SchedulerOutput()
        self._bound_paused(now, out)  # no shortage: admissions go on (unlike a preemption)
        budget = self.config.max_num_batched_tokens
        self.order.sort(self.ready, now)
        self.order.sort(self.waiting, now)
        # Ready sequences take free seats first: each costs one token, and they hold blocks.
        while self.ready and len(self.running) < self.config.max_num_seqs:
            seated = self.ready.popleft()
            self.order.seated(seated)
            self.running.append(seated)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, num_new, out):
                break
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        # Admitting new work right after preempting would only thrash the cache.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            hits = self.block_manager.cached_prefix(seq)
            num_computed = len(hits) * self.block_manager.block_size
            if self._admit_loading(seq, hits, out, now):
                continue
            num_new = min(seq.num_tokens - num_computed, budget)
            if not self.block_manager.allocate_slots(seq, num_new, hits):
                if self._never_fits(seq):
                    self.waiting.popleft()
                    out.dropped.append(seq)
                    continue
                break
            self.waiting.popleft()
            self.order.seated(seq)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_computed
                seq.first_scheduled_s = now
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        for seq in out.dropped:
            logger.warning(
                "request %s needs more KV blocks than the cache holds; finished as 'length'",
                seq.request_id,
            )
            seq.status = SequenceStatus.FINISHED_LENGTH
        return out

    def _admit_loading(
        self, seq: PagedSequence, hits: list[int], out: SchedulerOutput, now: float
    ) -> bool:
        """A prefix that continues in the host tier: blocks for it are taken now and filled by
        copies, and ``seq`` waits in ``loading`` (no seat, no tokens of this step) until they
        are in. Its tokens count as computed: nothing recomputes them. False: no host hit, or
        no room (then it is admitted as usual, or waits)."""
        slots = self.block_manager.host_prefix(seq, len(hits))
        if not slots:
            return False
        bs = self.block_manager.block_size
        if not self.block_manager.allocate_slots(seq, len(slots) * bs, hits):
            return False
        self.waiting.popleft()
        self.order.seated(seq)
        first = len(hits)
        seq.num_computed_tokens += len(slots) * bs
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.num_host_cached_tokens = len(slots) * bs
            seq.first_scheduled_s = now
        seq.status = SequenceStatus.RUNNING
        self.loading.append(seq)
        out.loads.append((seq, list(zip(slots, seq.block_table[first:], strict=False))))
        return True

    def _make_room(self, seq: PagedSequence, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for ``seq``, preempting as needed: first the newest ``ready`` sequence
        (it holds blocks but no seat, and may never get one while they are short: seats wait
        for blocks that it holds), then from the back of ``running``.

        Returns False when ``seq`` itself had to be preempted (or dropped).
        """
        while not self.block_manager.allocate_slots(seq, num_new):
            holders = self._paused_holders()
            if holders:  # a reader that stopped reading yields before any that reads
                self._release_paused(holders[0])
                out.preempted.append(holders[0])
                continue
            victim = self._victim(seq)
            self.block_manager.free(victim)
            if victim is seq and self._never_fits(seq):
                out.dropped.append(victim)
                return False
            victim.reset_for_recompute()
            self.waiting.appendleft(victim)
            out.preempted.append(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
        return True

    def _victim(self, seq: PagedSequence) -> PagedSequence:
        """Taken out of its queue: a ``ready`` sequence if any, else one of the running ones
        this step has not scheduled yet (``seq`` and those after it), by ``order``."""
        if self.ready:
            return self.order.take_victim(self.ready)
        start = self.running.index(seq)
        unscheduled = self.running[start:]
        victim = self.order.take_victim(unscheduled)
        self.running[start:] = unscheduled
        return victim

    def stats_fields(self) -> dict[str, int]:
        """Its part of ``EngineStats``."""
        return {
            "num_waiting": len(self.waiting) + len(self.ready) + len(self.loading),
            "num_running": len(self.running),
            "num_paused": len(self.paused),
            "num_preemptions": self.num_preemptions,
        }

    def _paused_holders(self) -> list[PagedSequence]:
        """Paused sequences that still hold blocks, oldest pause first."""
        return [s for s in self.paused if s.block_table]

    def _bound_paused(self, now: float, out: SchedulerOutput) -> None:
        holders = self._paused_holders()
        excess = len(holders) - self.config.max_paused_requests
        for i, seq in enumerate(holders):
            if i < excess or now - self._paused_at[seq.request_id] >= self.config.max_pause_s:
                self._release_paused(seq)
                out.released.append(seq)

    def _release_paused(self, seq: PagedSequence) -> None:
        """A paused sequence gives its blocks back; it stays paused (recomputed on resume)."""
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1

    def _never_fits(self, seq: PagedSequence) -> bool:
        """Even an empty cache could not hold this sequence's next step."""
        return self.block_manager.blocks_needed(seq.num_tokens) > self.block_manager.num_blocks

    def remove(self, seq: PagedSequence) -> None:
        """Stop scheduling a sequence; the caller owns freeing (or pinning) its blocks."""
        self._paused_at.pop(seq.request_id, None)
        for queue in (self.running, self.waiting, self.ready, self.paused, self.loading):
            if seq in queue:
                queue.remove(seq)
                return
