"""Where a request's time went: its phases, in order, contiguous from arrival to its end.

The router cuts a request's life into segments as it moves (``PhaseClock.enter``); every instant
belongs to exactly one phase, so the phases before the first token add up to the TTFT the
router measured, and all of them to the request's latency. A phase a worker can see into is
split by what the worker reports (``PhaseClock.split``): the prefill call into the prefill
worker's queue, its compute and the call's own cost; decode admission into the wait and the
KV pull. The rule of what each phase holds is written once, here (``RequestPhase``); the final
message, the OpenAI usage extension, ``pdserve_request_phase_seconds`` and the request's trace
(``router/request_trace.py``) all read these segments. Pure: the clock is the caller's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestPhase(enum.Enum):
    # Before the first token (they sum to the TTFT):
    ROUTER = "router"  # received -> first plan: auth, parsing, validation, tokenization
    FLOW_QUEUE = "flow_queue"  # waiting in the router's flow control queues (docs/slo.md)
    ROUTE = "route"  # the plan: load snapshot, prefix-index lookups
    KV_PEER_PULL = "kv_peer_pull"  # the prefill worker pulls the prompt's prefix (a plan's)
    PREFILL_QUEUE = "prefill_queue"  # on the prefill worker: call received -> its first step
    PREFILL_COMPUTE = "prefill_compute"  # its first step -> the first token sampled
    PREFILL_RPC = "prefill_rpc"  # the rest of the Prefill call: network, (de)serialization
    LOCAL_PREFILL = "local_prefill"  # a decode worker prefills (local, colocated): -> 1st token
    MIGRATION = "migration"  # a worker failed -> the next attempt plans (a healthy pool)
    # After the first token:
    DECODE_ADMISSION = "decode_admission"  # decode worker choice, waits for room, retries
    KV_TRANSFER = "kv_transfer"  # the decode worker's KV pull
    DECODE = "decode"  # admitted (or first token, local) -> the last token


@dataclass(frozen=True)
class Segment:
    phase: RequestPhase
    start_s: float
    end_s: float
    attempt: int  # the try it belongs to (0: the first; a migration starts the next)

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


class PhaseClock:
    """A request's segments. ``enter`` closes the open segment at ``now`` and opens the next;
    ``close`` ends the last. Times are the caller's monotonic clock, in seconds."""

    def __init__(self, start_s: float, phase: RequestPhase = RequestPhase.ROUTER) -> None:
        self.segments: list[Segment] = []
        self.attempt = 0
        self._open: tuple[RequestPhase, float] | None = (phase, start_s)

    @property
    def current(self) -> RequestPhase | None:
        return self._open[0] if self._open is not None else None

    def enter(self, phase: RequestPhase, now: float) -> Segment | None:
        """Closes the open segment at ``now`` (returned) and opens ``phase``."""
        closed = self._close(now)
        if phase is RequestPhase.MIGRATION:
            self.attempt += 1  # what follows the migration is the next attempt's
        self._open = (phase, now)
        return closed

    def close(self, now: float) -> Segment | None:
        return self._close(now)

    def _close(self, now: float) -> Segment | None:
        if self._open is None:
            return None
        phase, start_s = self._open
        self._open = None
        segment = Segment(phase, start_s, max(now, start_s), self.attempt)
        self.segments.append(segment)
        return segment

    def split(
        self,
        segment: Segment,
        parts: tuple[RequestPhase, ...],
        seconds: tuple[float, ...],
        rest: RequestPhase | None,
    ) -> list[Segment]:
        """Replaces a closed ``segment`` by consecutive ``parts`` of the given durations (what a
        worker measured inside it), clamped to fit, then ``rest`` for what remains (None: the
        remainder goes to the last part). Returns the new segments."""
        index = self.segments.index(segment)
        start = segment.start_s
        pieces: list[Segment] = []
        for phase, length in zip(parts, seconds, strict=True):
            end = min(start + max(length, 0.0), segment.end_s)
            pieces.append(Segment(phase, start, end, segment.attempt))
            start = end
        if rest is not None:
            pieces.append(Segment(rest, start, segment.end_s, segment.attempt))
        elif pieces:
            last = pieces[-1]
            pieces[-1] = Segment(last.phase, last.start_s, segment.end_s, last.attempt)
        self.segments[index : index + 1] = pieces
        return pieces

    def totals(self, until_s: float | None = None) -> dict[RequestPhase, float]:
        """Seconds per phase over every attempt, in first-seen order; ``until_s``: only time
        before it (the first token's instant gives the TTFT's phases)."""
        totals: dict[RequestPhase, float] = {}
        for s in self.segments:
            if until_s is not None and s.start_s >= until_s:
                continue
            end = s.end_s if until_s is None else min(s.end_s, until_s)
            totals[s.phase] = totals.get(s.phase, 0.0) + (end - s.start_s)
        return totals
