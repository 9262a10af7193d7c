"""The failure table (router/failures.py), row by row with exact values, and the copy of it in
docs/architecture.md kept equal to the code's."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from router.failures import FAILURE_TABLE, Action, Event, Phase, Seen, Verdict, classify

C = grpc.StatusCode
GONE = (C.UNAVAILABLE, C.CANCELLED, C.ABORTED, C.INTERNAL, C.UNKNOWN)
REPO = Path(__file__).resolve().parents[2]


def _migrate(reason: str, **flags: bool) -> Verdict:
    return Verdict(Action.MIGRATE, reason, **flags)


NEXT = Verdict(Action.NEXT)
GIVE_UP = Verdict(Action.GIVE_UP)
# A dead engine's last words, in every phase where the request ran on it.
ENGINE_FAULTS: dict[Event, Verdict] = {
    Seen.ENGINE_FAULT_ALONE: Verdict(Action.QUARANTINE, "engine"),
    Seen.ENGINE_FAULT_IN_STEP: _migrate("engine", suspect=True),
    Seen.ENGINE_FAULT_BYSTANDER: _migrate("engine", suspect=True),
}

EXPECTED: dict[Phase, dict[Event, Verdict]] = {
    Phase.PREFILL: {
        C.UNAVAILABLE: _migrate("prefill", suspect=True, strike=True),
        C.CANCELLED: _migrate("prefill", strike=True),
        C.ABORTED: _migrate("prefill", strike=True),
        C.INTERNAL: _migrate("prefill", strike=True),
        C.UNKNOWN: _migrate("prefill", strike=True),
        C.DEADLINE_EXCEEDED: _migrate("prefill"),
        C.NOT_FOUND: _migrate("prefill"),
        Seen.STALL: _migrate("prefill", suspect=True),
        C.RESOURCE_EXHAUSTED: NEXT,
        Seen.NOT_ACCEPTING: NEXT,
        **ENGINE_FAULTS,
    },
    Phase.ADMISSION: {
        Seen.LEASE_ENDED: _migrate("transfer", avoid_prefill=True),
        C.RESOURCE_EXHAUSTED: NEXT,
        C.UNAVAILABLE: NEXT,
        C.PERMISSION_DENIED: NEXT,
        Seen.NOT_ACCEPTING: NEXT,
        Seen.ENGINE_FAULT_BYSTANDER: NEXT,
        C.CANCELLED: _migrate("transfer"),
        C.ABORTED: _migrate("transfer"),
        C.INTERNAL: _migrate("transfer"),
        C.UNKNOWN: _migrate("transfer"),
        C.DEADLINE_EXCEEDED: _migrate("transfer"),
        C.NOT_FOUND: _migrate("transfer"),
        Seen.STALL: _migrate("stall", suspect=True),
    },
    Phase.LOCAL: {
        C.UNAVAILABLE: NEXT,
        Seen.NOT_ACCEPTING: NEXT,
        C.FAILED_PRECONDITION: NEXT,
        C.CANCELLED: _migrate("unavailable", strike=True),
        C.ABORTED: _migrate("unavailable", strike=True),
        C.INTERNAL: _migrate("unavailable", strike=True),
        C.UNKNOWN: _migrate("unavailable", strike=True),
        C.DEADLINE_EXCEEDED: _migrate("stall"),
        C.NOT_FOUND: _migrate("transfer"),
        Seen.STALL: _migrate("stall", suspect=True),
        **ENGINE_FAULTS,
        Seen.ENGINE_FAULT_BYSTANDER: NEXT,  # not stepped yet: as a worker that turned it away
    },
    Phase.STREAM: {
        C.UNAVAILABLE: _migrate("unavailable", suspect=True, strike=True),
        C.CANCELLED: _migrate("unavailable", strike=True),
        C.ABORTED: _migrate("unavailable", strike=True),
        C.INTERNAL: _migrate("unavailable", strike=True),
        C.UNKNOWN: _migrate("unavailable", strike=True),
        C.DEADLINE_EXCEEDED: _migrate("stall"),
        C.NOT_FOUND: _migrate("transfer"),
        Seen.STALL: _migrate("stall", suspect=True),
        **ENGINE_FAULTS,
    },
    Phase.RENEWAL: {
        C.UNAVAILABLE: _migrate("transfer", suspect=True),
        C.CANCELLED: _migrate("transfer"),
        C.ABORTED: _migrate("transfer"),
        C.INTERNAL: _migrate("transfer"),
        C.UNKNOWN: _migrate("transfer"),
        C.DEADLINE_EXCEEDED: _migrate("transfer", suspect=True),
        C.NOT_FOUND: _migrate("transfer"),
        Seen.LEASE_ENDED: _migrate("transfer"),
    },
}


@pytest.mark.parametrize("phase", list(Phase))
def test_every_row_of_every_phase(phase: Phase) -> None:
    assert FAILURE_TABLE[phase] == EXPECTED[phase]
    for event, verdict in EXPECTED[phase].items():
        assert classify(phase, event) == verdict


@pytest.mark.parametrize("phase", list(Phase))
def test_what_no_row_names_goes_back_to_the_client(phase: Phase) -> None:
    named = set(EXPECTED[phase])
    for code in C:
        if code not in named and code is not C.OK:
            assert classify(phase, code) == GIVE_UP, code
    # Bad input, a layout mismatch, a corrupted transfer fail the same way on any worker.
    for code in (C.INVALID_ARGUMENT, C.FAILED_PRECONDITION, C.DATA_LOSS):
        if code not in named:  # LOCAL: FAILED_PRECONDITION is another model's worker
            assert classify(phase, code).action is Action.GIVE_UP


def test_only_a_silent_loss_strikes_the_request() -> None:
    """Never a stall, a drain, a transfer, or an engine with last words (they name the
    request as the cause: quarantine; or say it was one of several, or not there)."""
    for phase, rows in FAILURE_TABLE.items():
        for event, verdict in rows.items():
            if verdict.strike:
                assert event in GONE, (phase, event)
                assert phase in (Phase.PREFILL, Phase.LOCAL, Phase.STREAM)
                assert verdict.action is Action.MIGRATE
            if verdict.action is Action.QUARANTINE:
                assert event is Seen.ENGINE_FAULT_ALONE


def _doc_rows() -> dict[tuple[str, str], tuple[str, ...]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("<!-- failure-table -->")[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in {p.value for p in Phase}:
            rows[(cells[0], cells[1])] = tuple(cells[2:])
    return rows


def doc_row(verdict: Verdict) -> tuple[str, ...]:
    yes = {True: "yes", False: ""}
    return (
        verdict.action.value,
        verdict.reason,
        yes[verdict.suspect],
        yes[verdict.avoid_prefill],
        yes[verdict.strike],
    )


def test_the_docs_reproduce_the_table() -> None:
    want = {
        (phase.value, getattr(event, "name", str(event))): doc_row(verdict)
        for phase, rows in FAILURE_TABLE.items()
        for event, verdict in rows.items()
    }
    for phase in Phase:
        want[(phase.value, "anything else")] = doc_row(GIVE_UP)
    assert _doc_rows() == want


def test_event_names_are_what_the_docs_print() -> None:
    for seen in Seen:
        assert re.fullmatch(r"[A-Z_]+", seen.name)


def test_trailers_name_what_the_code_alone_cannot() -> None:
    from pdserve.common.lease_release import LEASE_ENDED
    from pdserve.common.server import NOT_ACCEPTING
    from router.failures import event_of

    assert event_of(C.UNAVAILABLE, ()) is C.UNAVAILABLE
    assert event_of(C.UNAVAILABLE, (NOT_ACCEPTING,)) is Seen.NOT_ACCEPTING
    assert event_of(C.NOT_FOUND, (("x", "y"), LEASE_ENDED)) is Seen.LEASE_ENDED
    # A worker that was draining ran nothing: another takes the request, no strike, no count.
    assert classify(Phase.PREFILL, Seen.NOT_ACCEPTING) == NEXT


def test_a_dead_engines_last_words_are_read_from_its_trailer() -> None:
    from engine.serving_engine import FaultEvidence
    from pdserve.common.engine_fault import ENGINE_FAULT, engine_fault_trailers
    from router.failures import event_of

    seen = {
        FaultEvidence.ALONE: Seen.ENGINE_FAULT_ALONE,
        FaultEvidence.IN_STEP: Seen.ENGINE_FAULT_IN_STEP,
        FaultEvidence.BYSTANDER: Seen.ENGINE_FAULT_BYSTANDER,
    }
    for evidence, event in seen.items():
        assert event_of(C.UNAVAILABLE, engine_fault_trailers(evidence)) is event
    assert engine_fault_trailers(FaultEvidence.UNKNOWN) == ()  # reads as a silent loss
    assert event_of(C.UNAVAILABLE, ((ENGINE_FAULT, "what"),)) is C.UNAVAILABLE
    # Only on the status a dead engine's worker answers with.
    assert event_of(C.INTERNAL, engine_fault_trailers(FaultEvidence.ALONE)) is C.INTERNAL
