"""The router's waiting room, the I/O shell of flow control (docs/slo.md): it executes what
the pure decisions say. ``admit`` (``router/admission.py``) says whether a request may wait;
``FlowQueues`` (``router/flow_control.py``) says who goes to the workers next and who is shed;
``PrefillRate`` (``router/prefill_rate.py``) is what the room measures for the prediction.

Every public request passes through it (``RequestCore.responses``): ``enter`` admits it (or
raises ``Shed``) and waits until the queues release it, a wait bounded by its class's time to
live; the ``Seat`` it returns gives its prompt tokens back at the first token (``first_token``)
or when the request ends without one (``leave``). Requests go to the workers while the prompt
tokens in flight there stay within ``inflight_tokens_per_worker`` x the workers that compute
prompts. A client that leaves while waiting is taken out of the queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from pdserve.common import metrics
from router.admission import Admission, PoolRate, Verdict, admit
from router.flow_config import FlowConfig
from router.flow_control import FlowQueues, Ticket
from router.prefill_rate import PrefillRate
from router.prompts import Overloaded
from router.request_class import Tag

logger = logging.getLogger(__name__)

TTL_EXPIRED = "ttl_expired"  # the shed reason of a request whose wait outlived its class's TTL


class Shed(Overloaded):
    """Refused or shed by flow control: 429 (503 when no worker could take it), with the
    seconds after which a retry may be admitted."""

    def __init__(self, message: str, retry_after_s: int, reason: str) -> None:
        super().__init__(message, retry_after_s, unavailable=reason == Verdict.NO_WORKER.value)
        self.reason = reason


@dataclass
class _Waiting:
    ticket: Ticket
    tag: Tag
    admission: Admission
    released: asyncio.Future[None]
    # Set when it went to the workers: its tokens counted in flight, and the work predicted
    # still to compute then (itself included), for the overhead's measure.
    sent_s: float | None = None
    backlog: int = 0


class WaitingRoom:
    def __init__(
        self,
        config: FlowConfig,
        num_workers: Callable[[], int],
        clock: Callable[[], float] = time.perf_counter,
        num_decode_workers: Callable[[], int] | None = None,
    ) -> None:
        """``num_workers``: the workers that compute prompts now (the prefill pool's, or the
        decode pool's when colocated); ``num_decode_workers``: the decode pool's (the
        ``max_running_per_decode_worker`` bound's; default: ``num_workers``)."""
        self.config = config
        self.queues = FlowQueues(config.quantum_tokens)
        self.rate = PrefillRate(config.prefill_tokens_per_s)
        self._num_workers = num_workers
        self._num_decode_workers = num_decode_workers or num_workers
        self._running = 0  # requests sent to the workers, not yet ended
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}
        self._queued: dict[str, int] = {}  # by class
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None  # the deadline the timer is set for
        self._series: dict[str, _ClassSeries] = {}  # each class's metric series, looked up once

    def pool_rate(self, request_class: str) -> PoolRate:
        """What admission reads of the pool, for a request of ``request_class``."""
        workers = self._num_workers()
        return PoolRate(
            self.rate.tokens_per_s(workers),
            self.rate.overhead_s,
            self.rate.pending_tokens(self._clock(), workers),
            workers,
            self.rate.correction(request_class),
        )

    async def enter(self, request_id: str, tag: Tag, cost: int) -> Seat:
        """Admits the request of ``cost`` prompt tokens and waits for its turn. Raises
        ``Shed`` (refused at once, or shed when its wait outlived its class's TTL)."""
        cost = max(1, cost)
        now = self._clock()
        self._release(now)  # what expired goes first: the counts below are current
        cls = tag.request_class
        ahead = self.queues.tokens_ahead(tag.band, tag.key, cost)
        queued = self._queued.get(cls.name, 0)
        admission = admit(tag, cost, ahead, queued, self.pool_rate(cls.name))
        if not admission.admitted:
            reason = admission.verdict.value
            metrics.FLOW_SHED.labels(cls.name, reason).inc()
            metrics.key_shed(tag.key).inc()
            logger.info("request_id=%s shed (%s): %s", request_id, reason, admission.reason)
            raise Shed(admission.reason, admission.retry_after_s, reason)
        series = self.series(cls.name)
        series.admitted.inc()
        metrics.key_admitted(tag.key).inc()
        deadline = now + cls.queue_ttl_s
        ticket = Ticket(request_id, tag.key, tag.band, cost, now, deadline, cls.load_share)
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queues.push(ticket)
        entry = self._waiting[request_id] = _Waiting(ticket, tag, admission, released)
        self._queued[cls.name] = self._queued.get(cls.name, 0) + 1
        series.queued.inc()
        self._release(now)
        waited = not released.done()
        try:
            await released  # bounded: its deadline sheds it (the timer below)
        except asyncio.CancelledError:  # its client left (the future is cancelled with it)
            left = self._clock()
            if request_id in self.queues:
                self.queues.remove(request_id)
                self._unqueued(request_id)
            elif entry.sent_s is not None:
                # Released before it could resume: it never ran.
                self.rate.dropped(cost, left, self._num_workers())
                self._running -= 1
            self._release(left)
            raise
        assert entry.sent_s is not None  # set with its release
        series.wait.observe(entry.sent_s - now)
        return Seat(self, ticket, tag, admission, entry.sent_s, entry.backlog, waited)

    def _unqueued(self, request_id: str) -> _Waiting:
        waiting = self._waiting.pop(request_id)
        name = waiting.tag.request_class.name
        self._queued[name] -= 1
        self.series(name).queued.dec()
        return waiting

    def _release(self, now: float) -> None:
        """Executes ``FlowQueues.release`` now, and sets the timer for its next deadline."""
        config = self.config
        budget = config.inflight_tokens_per_worker * max(1, self._num_workers())
        seats = config.max_running_per_decode_worker * max(1, self._num_decode_workers())
        inflight = max(0, self.rate.inflight_tokens)
        release = self.queues.release(now, inflight, budget, self._running, seats)
        for ticket in release.shed:
            waiting = self._unqueued(ticket.request_id)
            name = waiting.tag.request_class.name
            metrics.FLOW_SHED.labels(name, TTL_EXPIRED).inc()
            metrics.key_shed(ticket.key).inc()
            if not waiting.released.done():
                ttl = waiting.tag.request_class.queue_ttl_s
                ahead = self.queues.tokens_ahead(ticket.band, ticket.key, ticket.cost)
                message = (
                    f"waited {now - ticket.arrival_s:.1f} s in the router's queue: its class "
                    f"{name!r}'s queue_ttl_s ({ttl:g})"
                )
                retry = max(1, math.ceil(self.pool_rate(name).seconds(ahead)))
                waiting.released.set_exception(Shed(message, retry, TTL_EXPIRED))
        for ticket in release.dispatch:
            waiting = self._unqueued(ticket.request_id)
            if waiting.released.done():  # cancelled: its client left; it goes nowhere
                continue
            workers = self._num_workers()
            self.rate.sent(ticket.cost, now, workers)
            self._running += 1
            waiting.sent_s, waiting.backlog = now, self.rate.pending_tokens(now, workers)
            waiting.released.set_result(None)
        metrics.FLOW_INFLIGHT_TOKENS.set(self.rate.inflight_tokens)
        self._arm(now)

    def _arm(self, now: float) -> None:
        """The timer set for the earliest deadline (reset only when that changes: the common
        release moves nothing)."""
        deadline = self.queues.next_deadline_s()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, deadline - now), self._expire
            )

    def _expire(self) -> None:
        self._timer, self._timer_at = None, None
        self._release(self._clock())

    def series(self, name: str) -> _ClassSeries:
        found = self._series.get(name)
        if found is None:
            found = self._series[name] = _ClassSeries(
                metrics.FLOW_ADMITTED.labels(name),
                metrics.FLOW_QUEUED.labels(name),
                metrics.FLOW_WAIT_S.labels(name),
                metrics.TTFT_PREDICTION_ERROR.labels(name),
            )
        return found


@dataclass(frozen=True)
class _ClassSeries:
    """One class's series of flow control's metrics (``labels`` costs a lookup per call)."""

    admitted: Counter
    queued: Gauge
    wait: Histogram
    prediction_error: Histogram


class Seat:
    """A released request: its prompt tokens in flight until its first token, itself among
    the running until its end (``leave``, which every request reaches)."""

    def __init__(
        self,
        room: WaitingRoom,
        ticket: Ticket,
        tag: Tag,
        admission: Admission,
        sent_s: float,
        backlog: int,
        waited: bool,
    ) -> None:
        self.room = room
        self.ticket = ticket
        self.tag = tag
        self.admission = admission
        self.sent_s = sent_s
        self._backlog = backlog  # predicted still to compute when it went, itself included
        # Its time in the queue (``ticket.arrival_s`` to ``sent_s``), when it had to wait:
        # the request's ``flow_queue`` phase (``router/phases.py``).
        self.queued = (ticket.arrival_s, sent_s) if waited else None
        self._held = True  # its prompt tokens, until its first token
        self._ended = False

    def first_token(self) -> None:
        """Its first token is back: its tokens leave the count, measured as served; the
        prediction it was admitted with is checked against its measured TTFT."""
        if not self._held or self._ended:
            return
        self._held = False
        room, now = self.room, self.room._clock()
        workers = room._num_workers()
        room.rate.observe_overhead(now - self.sent_s, self._backlog, workers)
        room.rate.served(self.ticket.cost, now, workers)
        measured = now - self.ticket.arrival_s
        if measured > 0:
            name = self.tag.request_class.name
            predicted = self.admission.predicted_ttft_s
            room.series(name).prediction_error.observe(abs(predicted - measured) / measured)
            room.rate.observe_ttft(name, self.admission.formula_ttft_s, measured)
        room._release(now)

    def leave(self) -> None:
        """The request ended (idempotent): its place among the running goes back, and its
        tokens if still held, unmeasured."""
        if self._ended:
            return
        self._ended = True
        room, now = self.room, self.room._clock()
        room._running -= 1
        if self._held:
            self._held = False
            room.rate.dropped(self.ticket.cost, now, room._num_workers())
        room._release(now)
