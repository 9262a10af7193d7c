"""What the vLLM engine (on the worker's event loop) and pdserve's KV connector (inside vLLM's
step, in the step thread) share about each request's blocks. One per engine, in one process:
vLLM builds the connector itself and finds its bridge by the id in the connector's config.

The block lifecycle is the contract in ``kvtransfer/base.py``; here is only its bookkeeping:
- prefill: the connector records a finished prefill-only request's blocks as *pinned* (vLLM
  then keeps them until the request is reported finished sending); ``release`` (the lease ended)
  queues that report, once.
- decode: the connector records the blocks vLLM allocated for a request's remote KV and hands
  them to the waiting ``admit_prefilled``; ``load_finished`` (the pull returned or failed)
  queues the finished-receiving report (and the failure), once. A request loads at most once:
  after a preemption vLLM recomputes it.
- attempts: one worker may add a request id again (a retry, a paused request resumed); each
  add carries its number (``attempt``), and the engine core's messages name it. A message of an
  attempt no longer wanted (its load given up, or an earlier add of the id) frees its blocks
  at once: an allocation is reported failed, a pin is the request table's to release
  (``RequestTable.pin_arrived``). Messages of one id arrive in the order of its adds.
Reports reach vLLM at its next step, which frees or schedules once every rank reported them:
with the engine core in this process its one rank takes them in the step (``take_reports``;
``seen``: till vLLM saw them the engine keeps stepping); with one in a process of its own the
front-end gives them to every rank as soon as they are here (``on_report``, through the hub),
and vLLM keeps stepping while a request waits for one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_engine.core_channel import CoreChannel

if TYPE_CHECKING:
    from vllm_engine.kv_pages import VllmKVPages

_bridges: dict[str, Bridge] = {}
_ids = itertools.count()
logger = logging.getLogger(__name__)


def find_bridge(bridge_id: str) -> Bridge:
    try:
        return _bridges[bridge_id]
    except KeyError:
        # vLLM built the connector in another process (its workers: tensor parallelism).
        raise RuntimeError(
            f"pdserve connector: no bridge {bridge_id!r} in this process; KV transfer needs "
            "vLLM's engine and worker in the worker's process (tensor_parallel_size 1)"
        ) from None


@dataclass(frozen=True)
class Reports:
    """What the connector tells vLLM at one step (vLLM's internal request ids)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)  # failed ones included
    failed_recving: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Pin:
    attempt: int
    internal_id: str
    block_ids: list[int]


class Bridge(CoreChannel):
    def __init__(
        self, loop: asyncio.AbstractEventLoop, fingerprint: str, vllm_version: str
    ) -> None:
        self.id = f"bridge-{next(_ids)}"
        self._loop = loop
        self.fingerprint, self.vllm_version = fingerprint, vllm_version  # name the KV layout
        self._lock = threading.Lock()
        self.kv_pages: VllmKVPages | None = None  # set when vLLM registers its KV caches
        self._pinned: dict[str, _Pin] = {}
        # rid -> the attempt whose allocation is awaited, and its future
        self._waiting: dict[str, tuple[int, asyncio.Future[list[int]]]] = {}
        # rid -> attempt -> internal id: allocated, not yet filled (an earlier add of the id
        # may still be filling when the next one is allocated: each is reported on its own)
        self._loading: dict[str, dict[int, str]] = {}
        self._loaded: set[str] = set()  # rids whose load is over (never loaded again)
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._unseen: set[str] = set()  # taken, not yet in vLLM's aggregated output
        # Bumped whenever a step moved a request's blocks along (pinned, allocated, reported):
        # such a step was not idle, whatever it scheduled.
        self.events = 0
        # Told (on the event loop) when there are reports to give vLLM: an engine core in a
        # process of its own steps by itself, so they go to its ranks at once.
        self.on_report: Callable[[], None] | None = None
        _bridges[self.id] = self

    def close(self) -> None:
        _bridges.pop(self.id, None)

    # ---- the connector (step thread) --------------------------------------------------------
    def pin(self, rid: str, attempt: int, internal_id: str, block_ids: list[int]) -> None:
        with self._lock:
            held = self._pinned.get(rid)
            pin = _Pin(attempt, internal_id, block_ids)
            if held is not None:  # never here (an earlier add's pin goes as it arrives)
                logger.error("request %s: pins of adds %d and %d", rid, attempt, held.attempt)
                older, self._pinned[rid] = sorted((held, pin), key=lambda p: p.attempt)
                self._sent.add(older.internal_id)  # the earlier add's: no lease reads it
            else:
                self._pinned[rid] = pin
            self.events += 1
        if held is not None:
            self._reported_now()

    def should_load(self, rid: str) -> bool:
        with self._lock:
            return rid not in self._loaded and rid not in self._loading

    def allocated(
        self, rid: str, attempt: int, internal_id: str, block_ids: list[int], waits: bool
    ) -> None:
        """``waits``: vLLM parked the request until told its load finished (else its own
        prefix cache held every block, and it must not be told)."""
        with self._lock:
            waiting = self._waiting.get(rid)
            stale = waiting is None or waiting[0] != attempt  # given up, or an earlier add
            if stale and waits:  # vLLM keeps the blocks until told the load is over
                self._received.add(internal_id)
                self._failed.add(internal_id)
            elif not stale:
                del self._waiting[rid]
                if waits:
                    self._loading.setdefault(rid, {})[attempt] = internal_id
                else:
                    self._loaded.add(rid)
            self.events += 1
        if waiting is not None and not stale:
            self._loop.call_soon_threadsafe(_resolve, waiting[1], block_ids)
        if stale and waits:
            self._reported_now()

    def take_reports(self) -> Reports:
        with self._lock:
            reports = Reports(self._sent, self._received, self._failed)
            self._sent, self._received, self._failed = set(), set(), set()
            self._unseen |= reports.finished_sending | reports.finished_recving
            self.events += bool(reports.finished_sending or reports.finished_recving)
            return reports

    def seen(self, finished_sending: set[str], finished_recving: set[str]) -> None:
        """vLLM's scheduler got these from every rank (the step's aggregated output)."""
        with self._lock:
            self._unseen -= finished_sending | finished_recving

    # ---- the engine (event loop) ------------------------------------------------------------
    def expect_allocation(self, rid: str, attempt: int) -> asyncio.Future[list[int]]:
        """The allocation of ``rid``'s add number ``attempt`` (any other's is stale)."""
        future: asyncio.Future[list[int]] = self._loop.create_future()
        with self._lock:
            self._waiting[rid] = (attempt, future)
        return future

    def refuse(self, rid: str, error: Exception) -> None:
        """vLLM refused to add ``rid``: an admission waiting for its blocks gets ``error``."""
        with self._lock:
            waiting = self._waiting.pop(rid, None)
        if waiting is not None and not waiting[1].done():
            waiting[1].set_exception(error)

    def pinned(self, rid: str) -> list[int]:
        with self._lock:
            return list(self._pinned[rid].block_ids)

    def is_pinned(self, rid: str, attempt: int) -> bool:
        with self._lock:
            pin = self._pinned.get(rid)
            return pin is not None and pin.attempt == attempt

    def release(self, rid: str) -> None:
        """The pinned blocks may go (``KeyError`` when not pinned: a second release)."""
        with self._lock:
            pin = self._pinned.pop(rid)
            self._sent.add(pin.internal_id)
        self._reported_now()

    def load_finished(self, rid: str, attempt: int, ok: bool) -> bool:
        """The fill of the blocks of ``rid``'s add number ``attempt`` returned (``ok``) or
        failed; False when it held none (not allocated yet, or already reported)."""
        with self._lock:
            waiting = self._waiting.get(rid)
            if waiting is not None and waiting[0] == attempt:
                # Its allocation may still come: stale then, and reported failed at once.
                del self._waiting[rid]
            loading = self._loading.get(rid, {})
            internal_id = loading.pop(attempt, None)
            if not loading:
                self._loading.pop(rid, None)
            self._loaded.add(rid)
            if internal_id is None:
                return False
            self._received.add(internal_id)
            if not ok:
                self._failed.add(internal_id)
        self._reported_now()
        return True

    def _reported_now(self) -> None:
        if self.on_report is not None:
            self.on_report()

    def forget(self, rid: str) -> None:
        """The request is over on every side."""
        with self._lock:
            self._loaded.discard(rid)

    def has_reports(self) -> bool:
        """Reports not yet taken, or taken and not yet seen by vLLM's scheduler."""
        with self._lock:
            return bool(self._sent or self._received or self._unseen)

    @property
    def num_loading(self) -> int:
        with self._lock:
            return sum(map(len, self._loading.values()))

    @property
    def num_pinned(self) -> int:
        with self._lock:
            return len(self._pinned)


def _resolve(future: asyncio.Future[list[int]], block_ids: list[int]) -> None:
    if not future.done():
        future.set_result(block_ids)
