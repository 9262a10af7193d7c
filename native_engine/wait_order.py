"""The native scheduler's order (``SchedulerConfig.scheduling_policy``): which waiting or ready
sequence goes first, and which one gives its blocks back under KV pressure. Pure, no torch.

- ``fcfs``: arrival order; the victim is the most recently admitted (vLLM's fcfs).
- ``priority``: ``params.priority`` (lower first), then arrival; the victim is the lowest
  priority, most recent arrival (vLLM's priority policy). **Aging**: a sequence waiting for a
  seat gains one priority level per ``priority_aging_s`` seconds of its current wait, so a
  stream of more urgent requests delays a less urgent one, never starves it: behind a constant
  stream one level more urgent, it waits at most about ``priority_aging_s`` seconds per level.
  Age counts the current wait only: a preempted sequence starts its next wait young.

The scheduler (``native_engine/scheduler.py``) calls ``arrived`` as a sequence enters,
``sort`` on its queues at each step, ``seated`` as one leaves them for a seat, and
``take_victim`` when blocks run short.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import MutableSequence

from engine.config import SchedulingPolicy
from native_engine.paged_sequence import PagedSequence


class WaitOrder:
    def __init__(self, policy: SchedulingPolicy, aging_s: float) -> None:
        self.policy = policy
        self.aging_s = aging_s
        self._count = itertools.count()
        # A sequence's arrival number and the step clock's reading when its wait began;
        # weak: a finished sequence leaves with its object.
        self._seen: weakref.WeakKeyDictionary[PagedSequence, tuple[int, float | None]] = (
            weakref.WeakKeyDictionary()
        )

    def arrived(self, seq: PagedSequence) -> None:
        """``seq`` entered the engine (once: a preempted one keeps its place in time)."""
        if seq not in self._seen:
            self._seen[seq] = (next(self._count), None)

    def seated(self, seq: PagedSequence) -> None:
        """``seq`` left the queue for a seat: its age counts waits only, so a preempted one
        starts its next wait young (a long run does not age it past urgent work)."""
        number, _ = self._seen.get(seq, (next(self._count), None))
        self._seen[seq] = (number, None)

    def sort(self, queue: deque[PagedSequence], now: float) -> None:
        """Puts ``queue`` in serving order (``fcfs``: left as it is)."""
        if self.policy is SchedulingPolicy.FCFS or len(queue) < 2:
            return
        ordered = sorted(queue, key=lambda seq: self._key(seq, now))
        queue.clear()
        queue.extend(ordered)

    def take_victim(self, candidates: MutableSequence[PagedSequence]) -> PagedSequence:
        """Removes and returns the sequence to preempt among ``candidates`` (non-empty, in
        admission order)."""
        if self.policy is SchedulingPolicy.FCFS:
            return candidates.pop()
        index = max(range(len(candidates)), key=lambda i: self._rank(candidates[i]))
        victim = candidates[index]
        del candidates[index]
        return victim

    def _rank(self, seq: PagedSequence) -> tuple[int, int]:
        """Lower first: (priority, arrival number)."""
        number, _ = self._seen.get(seq, (0, None))
        return seq.params.priority, number

    def _key(self, seq: PagedSequence, now: float) -> tuple[int, int]:
        """``_rank`` with the waiting sequence's age taken off its priority."""
        number, since = self._seen.get(seq, (0, None))
        if since is None:
            self._seen[seq] = (number, now)
            since = now
        aged = int((now - since) // self.aging_s)
        return seq.params.priority - aged, number
