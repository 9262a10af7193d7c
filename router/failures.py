"""What the router does when a call to a worker fails: one table, (phase, what happened) ->
verdict. Every caller classifies through ``classify`` (prefill and admission in
``router/dispatch.py``, the local admission in ``router/generation.py``, the relay, lease
renewal); ``docs/architecture.md`` reproduces ``FAILURE_TABLE`` (a unit test keeps them equal).

Pure: no I/O. The verdict says whether another worker of the same step may take the request
(``NEXT``: nothing failed, this worker just cannot take it now), whether a worker failed and the
request goes on elsewhere (``MIGRATE``: counted against ``migration_limit``, whatever the phase,
so one request costs at most ``migration_limit + 1`` worker failures), whether the failure
is the request's own and goes back to the client with its status (``GIVE_UP``), or whether the
dead worker's last words name this request as what killed it (``QUARANTINE``: it ends, and is
refused for ``quarantine_s``). A silent loss, which the request may have caused, is a
``strike`` against it (``router/quarantine.py``); one the worker's last words speak of is none.
What a migrated request is asked for next: ``router/migration.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

import grpc

from engine.serving_engine import FaultEvidence
from pdserve.common.engine_fault import evidence_of
from pdserve.common.lease_release import LEASE_ENDED as LEASE_ENDED_TRAILER
from pdserve.common.server import NOT_ACCEPTING

__all__ = [
    "FAILURE_TABLE",
    "Action",
    "Event",
    "Phase",
    "Seen",
    "Verdict",
    "classify",
    "event_of",
]


class Phase(Enum):
    PREFILL = "prefill"  # Prefill on a prefill worker
    ADMISSION = "admission"  # Decode until admitted: the decode worker pulls the prefilled KV
    LOCAL = "local"  # PrefillAndDecode until queued (conditional disaggregation, colocated)
    STREAM = "stream"  # a decode worker's token stream, once admitted
    RENEWAL = "renewal"  # RenewLease on the prefill worker while decode workers are full


class Seen(Enum):
    """What the router saw instead of a status code."""

    # No message for stall_timeout_s, or the worker stopped answering stats calls (frozen).
    STALL = "stall"
    # A status carrying the lease-ended trailer, or a renewal refused: the prefilled KV is gone.
    LEASE_ENDED = "lease_ended"
    # A worker draining or still loading turned the call away (its NOT_ACCEPTING trailer):
    # nothing ran there.
    NOT_ACCEPTING = "not_accepting"
    # The worker's engine died; its last words on this request (pdserve/common/engine_fault.py):
    # the failed step held it alone (the cause), held it among others, or did not hold it.
    ENGINE_FAULT_ALONE = "engine_fault_alone"
    ENGINE_FAULT_IN_STEP = "engine_fault_in_step"
    ENGINE_FAULT_BYSTANDER = "engine_fault_bystander"


Event: TypeAlias = grpc.StatusCode | Seen


class Action(Enum):
    NEXT = "next"  # not a failure: another worker of this step (full, draining, not peered)
    MIGRATE = "migrate"  # a worker failed: the request goes on elsewhere, avoiding it
    GIVE_UP = "give_up"  # the request's own failure: the client gets the status
    # The worker's last words say this request killed it: it ends (INTERNAL), no other worker
    # is risked, and the same request is refused for quarantine_s (router/quarantine.py).
    QUARANTINE = "quarantine"


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""  # pdserve_migrations_total{reason}, for MIGRATE
    # The worker itself looks broken: no new work until its next stats call answers.
    suspect: bool = False
    # The KV it was pulling is spent: the next attempt also avoids the prefill worker.
    avoid_prefill: bool = False
    # The worker went away without a word (killed, crashed, cut off), so the request may have
    # caused it: a strike against the request (``router/quarantine.py``), so a poison request
    # stops spreading.
    strike: bool = False


_GIVE_UP = Verdict(Action.GIVE_UP)
_NEXT = Verdict(Action.NEXT)
# A broken connection or a dead server reads as any of these.
_GONE_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,  # its server stopped (a drain past the grace)
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,  # a broken HTTP/2 stream
    grpc.StatusCode.UNKNOWN,
)


def _gone(reason: str) -> dict[Event, Verdict]:
    """Rows for a worker that went away; only UNAVAILABLE suspects it (the others may be this
    request's own stream breaking)."""
    rows: dict[Event, Verdict] = {
        code: Verdict(
            Action.MIGRATE, reason, suspect=code is grpc.StatusCode.UNAVAILABLE, strike=True
        )
        for code in _GONE_CODES
    }
    return rows | _ENGINE_FAULTS


_STALLED = Verdict(Action.MIGRATE, "stall", suspect=True)
# A dead engine's last words, wherever the request ran on it (prefill, local, stream).
_ENGINE_FAULTS: dict[Event, Verdict] = {
    Seen.ENGINE_FAULT_ALONE: Verdict(Action.QUARANTINE, "engine"),
    # Among others: which of them caused it (if any) cannot be said, and striking them all
    # would end innocents batched with a poison twice: migration_limit bounds it instead.
    Seen.ENGINE_FAULT_IN_STEP: Verdict(Action.MIGRATE, "engine", suspect=True),
    Seen.ENGINE_FAULT_BYSTANDER: Verdict(Action.MIGRATE, "engine", suspect=True),
}

FAILURE_TABLE: dict[Phase, dict[Event, Verdict]] = {
    Phase.PREFILL: {
        **_gone("prefill"),
        grpc.StatusCode.DEADLINE_EXCEEDED: Verdict(Action.MIGRATE, "prefill"),  # prefill_timeout_s
        grpc.StatusCode.NOT_FOUND: Verdict(Action.MIGRATE, "prefill"),
        Seen.STALL: Verdict(Action.MIGRATE, "prefill", suspect=True),
        # This worker's cache cannot hold the prompt; a larger one may (none: check_capacity).
        grpc.StatusCode.RESOURCE_EXHAUSTED: _NEXT,
        Seen.NOT_ACCEPTING: _NEXT,
    },
    Phase.ADMISSION: {
        Seen.LEASE_ENDED: Verdict(Action.MIGRATE, "transfer", avoid_prefill=True),
        grpc.StatusCode.RESOURCE_EXHAUSTED: _NEXT,  # full: another, or wait with backoff
        grpc.StatusCode.UNAVAILABLE: _NEXT,  # draining, or gone before the pull
        grpc.StatusCode.PERMISSION_DENIED: _NEXT,  # does not know the prefill worker yet
        Seen.NOT_ACCEPTING: _NEXT,
        Seen.ENGINE_FAULT_BYSTANDER: _NEXT,  # its engine died before the pull: nothing ran
        # Mid-pull, maybe: the handle may be spent, prefill again.
        **{
            code: Verdict(Action.MIGRATE, "transfer")
            for code in (
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.ABORTED,
                grpc.StatusCode.INTERNAL,
                grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.NOT_FOUND,
            )
        },
        Seen.STALL: _STALLED,
    },
    Phase.LOCAL: {
        **_gone("unavailable"),
        grpc.StatusCode.UNAVAILABLE: _NEXT,  # draining or gone: disaggregate (colocated: next)
        Seen.ENGINE_FAULT_BYSTANDER: _NEXT,  # its engine died before stepping it
        Seen.NOT_ACCEPTING: _NEXT,
        # Another model's worker, before the router's stats refused it: any other worker.
        grpc.StatusCode.FAILED_PRECONDITION: _NEXT,
        grpc.StatusCode.DEADLINE_EXCEEDED: Verdict(Action.MIGRATE, "stall"),
        grpc.StatusCode.NOT_FOUND: Verdict(Action.MIGRATE, "transfer"),
        Seen.STALL: _STALLED,
    },
    Phase.STREAM: {
        **_gone("unavailable"),
        grpc.StatusCode.DEADLINE_EXCEEDED: Verdict(Action.MIGRATE, "stall"),
        grpc.StatusCode.NOT_FOUND: Verdict(Action.MIGRATE, "transfer"),
        Seen.STALL: _STALLED,
    },
    Phase.RENEWAL: {
        **{
            code: Verdict(Action.MIGRATE, "transfer", suspect=code is grpc.StatusCode.UNAVAILABLE)
            for code in _GONE_CODES
        },
        grpc.StatusCode.DEADLINE_EXCEEDED: Verdict(Action.MIGRATE, "transfer", suspect=True),
        grpc.StatusCode.NOT_FOUND: Verdict(Action.MIGRATE, "transfer"),
        Seen.LEASE_ENDED: Verdict(Action.MIGRATE, "transfer"),
    },
}


_EVIDENCE = {
    FaultEvidence.ALONE: Seen.ENGINE_FAULT_ALONE,
    FaultEvidence.IN_STEP: Seen.ENGINE_FAULT_IN_STEP,
    FaultEvidence.BYSTANDER: Seen.ENGINE_FAULT_BYSTANDER,
}


def event_of(code: grpc.StatusCode, trailers: tuple[tuple[str, str], ...]) -> Event:
    """What a failed call's status and trailers say happened: a trailer names a case the code
    alone cannot (a lease that ended, a worker that was not accepting work, what a dead
    engine knew of the request)."""
    if LEASE_ENDED_TRAILER in trailers:
        return Seen.LEASE_ENDED
    if NOT_ACCEPTING in trailers:
        return Seen.NOT_ACCEPTING
    evidence = evidence_of(trailers)
    if code == grpc.StatusCode.UNAVAILABLE and evidence in _EVIDENCE:
        return _EVIDENCE[evidence]
    return code


def classify(phase: Phase, event: Event) -> Verdict:
    """The verdict for ``event`` in ``phase``; anything the table does not name (bad input, a
    layout mismatch, a corrupted transfer...) would fail the same way anywhere: give up."""
    return FAILURE_TABLE[phase].get(event, _GIVE_UP)
