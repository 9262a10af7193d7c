"""The phase clock (router/phases.py): contiguous segments, splits by what a worker measured,
totals before the first token. Exact values on a scripted clock."""

from __future__ import annotations

from router.phases import PhaseClock, RequestPhase, Segment
from router.request_trace import RequestTrace

P = RequestPhase


def test_segments_are_contiguous_and_totals_add_up_to_the_request() -> None:
    clock = PhaseClock(10.0)
    clock.enter(P.ROUTE, 10.5)
    clock.enter(P.PREFILL_RPC, 10.75)
    clock.enter(P.DECODE_ADMISSION, 12.0)
    clock.enter(P.DECODE, 12.5)
    clock.close(15.0)
    assert [s.phase for s in clock.segments] == [
        P.ROUTER,
        P.ROUTE,
        P.PREFILL_RPC,
        P.DECODE_ADMISSION,
        P.DECODE,
    ]
    assert all(
        a.end_s == b.start_s for a, b in zip(clock.segments, clock.segments[1:], strict=False)
    )
    assert sum(clock.totals().values()) == 5.0
    # The first token went out at 12.0: the TTFT's phases.
    assert clock.totals(until_s=12.0) == {P.ROUTER: 0.5, P.ROUTE: 0.25, P.PREFILL_RPC: 1.25}


def test_a_call_splits_by_the_workers_measure_and_the_rest_is_the_calls_own() -> None:
    clock = PhaseClock(0.0)
    call = clock.enter(P.PREFILL_RPC, 1.0)
    assert call == Segment(P.ROUTER, 0.0, 1.0, 0)
    clock.enter(P.DECODE_ADMISSION, 3.0)
    prefill = clock.segments[-1]
    parts = clock.split(prefill, (P.PREFILL_QUEUE, P.PREFILL_COMPUTE), (0.5, 1.25), P.PREFILL_RPC)
    assert parts == [
        Segment(P.PREFILL_QUEUE, 1.0, 1.5, 0),
        Segment(P.PREFILL_COMPUTE, 1.5, 2.75, 0),
        Segment(P.PREFILL_RPC, 2.75, 3.0, 0),
    ]
    assert [s.phase for s in clock.segments] == [
        P.ROUTER,
        P.PREFILL_QUEUE,
        P.PREFILL_COMPUTE,
        P.PREFILL_RPC,
    ]
    assert clock.current is P.DECODE_ADMISSION


def test_a_worker_that_reports_more_than_the_call_took_is_clamped_to_the_call() -> None:
    clock = PhaseClock(0.0)
    clock.enter(P.PREFILL_RPC, 1.0)
    clock.enter(P.DECODE, 2.0)
    parts = clock.split(
        clock.segments[-1], (P.PREFILL_QUEUE, P.PREFILL_COMPUTE), (0.75, 5.0), P.PREFILL_RPC
    )
    assert [(s.phase, s.start_s, s.end_s) for s in parts] == [
        (P.PREFILL_QUEUE, 1.0, 1.75),
        (P.PREFILL_COMPUTE, 1.75, 2.0),
        (P.PREFILL_RPC, 2.0, 2.0),
    ]


def test_a_migration_starts_the_next_attempt_and_phases_add_over_attempts() -> None:
    clock = PhaseClock(0.0)
    clock.enter(P.ROUTE, 1.0)
    clock.enter(P.LOCAL_PREFILL, 2.0)
    clock.enter(P.DECODE, 4.0)
    clock.enter(P.MIGRATION, 6.0)
    clock.enter(P.ROUTE, 7.0)
    clock.enter(P.LOCAL_PREFILL, 7.5)
    clock.enter(P.DECODE, 8.0)
    clock.close(9.0)
    assert [s.attempt for s in clock.segments] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert clock.totals() == {
        P.ROUTER: 1.0,
        P.ROUTE: 1.5,
        P.LOCAL_PREFILL: 2.5,
        P.DECODE: 3.0,
        P.MIGRATION: 1.0,
    }
    assert clock.close(10.0) is None  # closed once


def test_a_clock_running_backwards_gives_an_empty_segment_not_a_negative_one() -> None:
    clock = PhaseClock(5.0)
    assert clock.enter(P.ROUTE, 4.0) == Segment(P.ROUTER, 5.0, 5.0, 0)


def test_a_peer_pull_is_its_own_phase_before_the_prefill_queue() -> None:
    """``RequestTrace.prefilled`` with the worker's ``peer_pull_phase_s``: the Prefill call
    splits into the pull, the queue, the compute, and the rest (the call's own)."""
    trace = RequestTrace("r", 0.0)
    trace.enter(RequestPhase.PREFILL_RPC, 1.0)
    trace.prefilled(3.0, 0.25, 1.0, RequestPhase.DECODE_ADMISSION, pull_s=0.5)
    assert trace.breakdown() == {
        "router": 1.0,
        "kv_peer_pull": 0.5,
        "prefill_queue": 0.25,
        "prefill_compute": 1.0,
        "prefill_rpc": 0.25,
    }
