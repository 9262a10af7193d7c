"""One request's phases (``router/phases.py``) and, when tracing is on, its trace.

``Generation`` calls ``enter`` at each boundary of the request's path; the clock records the
segment and, if the request is sampled, a live span per phase is started under the request's
root span (``pdserve.request``), so that the span of a worker call is known while the call
runs: its context travels in the call's metadata (``metadata``) and the worker's own spans
(queue, compute, KV pull) become its children. A phase a worker measured inside is split after
the call (``prefilled``, ``admitted``); its span keeps the whole call and says the split in
attributes. ``finish`` ends the spans and observes ``pdserve_request_phase_seconds``.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from pdserve.common import metrics, tracing
from router.phases import PhaseClock, RequestPhase, Segment
from router.plan import Route

# A call split afterwards is named for the whole call.
_SPAN_NAMES = {
    RequestPhase.PREFILL_RPC: "pdserve.prefill",
    RequestPhase.DECODE_ADMISSION: "pdserve.decode_admission",
}


class RequestTrace:
    def __init__(self, request_id: str, start_s: float) -> None:
        self.clock = PhaseClock(start_s)
        self.path = "none"  # the last attempt's route (``Route``'s value)
        self._counts: dict[str, int] = {}  # what the workers reported, summed over attempts
        self._root: trace.Span | None = None
        self._span: trace.Span | None = None
        tracer = tracing.tracer()
        if tracer is not None:
            root = tracer.start_span(
                "pdserve.request",
                start_time=tracing.ns(start_s),
                attributes={"pdserve.request_id": request_id},
            )
            if root.is_recording():  # sampled
                self._root = root
                self._span = self._start(RequestPhase.ROUTER, start_s)
            else:
                root.end()
        self._finished = False

    @property
    def sampled(self) -> bool:
        return self._root is not None

    def enter(self, phase: RequestPhase, now: float | None = None, **attrs: str | int) -> None:
        """The request moves on to ``phase`` (at ``now``, default: the current time)."""
        now = time.perf_counter() if now is None else now
        self.clock.enter(phase, now)
        if self._root is not None:
            self._end_span(now)
            self._span = self._start(phase, now, attrs)

    def routed(self, route: Route, reason: str = "") -> None:
        """The attempt's plan chose ``route`` (the last one is the request's path), for
        ``reason`` (the routing decision's: on the plan's span)."""
        self.path = route.value
        if self._span is not None and reason:
            self._span.set_attribute("pdserve.route_reason", reason)

    def count(self, name: str, value: int) -> None:
        """Adds a worker's count (host-tier tokens, speculation) to the root span's
        ``pdserve.<name>`` attribute."""
        if self._root is not None and value:
            self._counts[name] = self._counts.get(name, 0) + value

    def failed(self, reason: str, message: str) -> None:
        """The open phase ended in a worker failure (a migration follows)."""
        if self._span is not None:
            self._span.set_attribute("pdserve.failure", reason)
            self._span.set_status(Status(StatusCode.ERROR, message[:200]))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """For the worker call of the open phase: its span's context (nothing if unsampled)."""
        return tracing.metadata(self._span)

    def prefilled(
        self,
        first_token_s: float,
        queue_s: float,
        compute_s: float,
        then: RequestPhase,
        pull_s: float = 0.0,
    ) -> None:
        """The Prefill call answered and its first token went out at ``first_token_s``: the call
        splits into the worker's peer pull (``pull_s``), queue and compute and the call's own
        cost; ``then`` opens (decode admission, or nothing more to do when the first token
        ended the request)."""
        if self._span is not None:
            self._span.set_attribute("pdserve.prefill_queue_s", queue_s)
            self._span.set_attribute("pdserve.prefill_compute_s", compute_s)
            if pull_s:
                self._span.set_attribute("pdserve.kv_peer_pull_s", pull_s)
        self.enter(then, first_token_s)
        call = self._last(RequestPhase.PREFILL_RPC)
        if call is not None:
            parts: tuple[RequestPhase, ...] = (
                RequestPhase.PREFILL_QUEUE,
                RequestPhase.PREFILL_COMPUTE,
            )
            seconds: tuple[float, ...] = (queue_s, compute_s)
            if pull_s:
                parts, seconds = (RequestPhase.KV_PEER_PULL, *parts), (pull_s, *seconds)
            self.clock.split(call, parts, seconds, RequestPhase.PREFILL_RPC)

    def admitted(self, kv_pull_s: float) -> None:
        """A decode worker admitted the request after pulling its KV in ``kv_pull_s``."""
        if self._span is not None:
            self._span.set_attribute("pdserve.kv_pull_s", kv_pull_s)
        self.enter(RequestPhase.DECODE)
        wait = self._last(RequestPhase.DECODE_ADMISSION)
        if wait is not None:
            pull = min(max(kv_pull_s, 0.0), wait.seconds)
            self.clock.split(
                wait,
                (RequestPhase.DECODE_ADMISSION,),
                (wait.seconds - pull,),
                RequestPhase.KV_TRANSFER,
            )

    def breakdown(self, until_s: float | None = None) -> dict[str, float]:
        """Seconds by phase name (``until_s``: only before it, e.g. the first token)."""
        return {p.value: s for p, s in self.clock.totals(until_s).items()}

    def finish(self, attributes: dict[str, str | int | float] | None = None) -> None:
        """Ends the request's phases (observed in ``pdserve_request_phase_seconds``) and its
        spans; idempotent, and a request that ends early (an error, the client gone) ends
        here too."""
        if self._finished:
            return
        self._finished = True
        now = time.perf_counter()
        self.clock.close(now)
        for phase, seconds in self.clock.totals().items():
            metrics.REQUEST_PHASE_S.labels(phase.value, self.path).observe(seconds)
        if self._root is not None:
            self._end_span(now)
            for name, seconds in self.breakdown().items():
                self._root.set_attribute(f"pdserve.phase.{name}_s", seconds)
            self._root.set_attribute("pdserve.path", self.path)
            for name, count in self._counts.items():
                self._root.set_attribute(f"pdserve.{name}", count)
            for key, value in (attributes or {}).items():
                self._root.set_attribute(key, value)
            self._root.end(end_time=tracing.ns(now))

    def _start(
        self, phase: RequestPhase, now: float, attrs: dict[str, str | int] | None = None
    ) -> trace.Span | None:
        tracer = tracing.tracer()
        if tracer is None or self._root is None:
            return None
        return tracer.start_span(
            _SPAN_NAMES.get(phase, f"pdserve.{phase.value}"),
            context=trace.set_span_in_context(self._root),
            start_time=tracing.ns(now),
            attributes={"pdserve.attempt": self.clock.attempt, **(attrs or {})},
        )

    def _end_span(self, now: float) -> None:
        if self._span is not None:
            self._span.end(end_time=tracing.ns(now))
            self._span = None

    def _last(self, phase: RequestPhase) -> Segment | None:
        for segment in reversed(self.clock.segments):
            if segment.phase is phase:
                return segment
        return None
