"""``router/attempt.py``: a request's final facts folded from its attempts' typed events."""

from __future__ import annotations

from router.attempt import CacheHits, Ended, Prefilled, Report, Transferred
from router.plan import Route


def test_a_disaggregated_attempt_reports_its_prefill_transfer_and_finish() -> None:
    report = Report()
    for event in (Prefilled(0.25, 32), Transferred(0.5), Ended("stop")):
        report = report.add(event)
    assert report == Report("stop", 32, 0.25, 0.5)


def test_a_migrated_request_adds_times_and_keeps_the_client_prompts_cache_hits() -> None:
    first = Report().add(Prefilled(0.25, 48)).add(Transferred(0.5))  # then its worker was lost
    # The continuation's prefill reports no cache hits of the client's prompt (0).
    second = first.add(Prefilled(0.125, 0)).add(Transferred(0.25))
    final = second.add(Ended("length"))
    assert final == Report("length", 48, 0.375, 0.75)


def test_a_local_attempt_names_its_route_and_reports_its_cache_hits() -> None:
    report = Report().add(CacheHits(16)).add(Ended("stop", Route.LOCAL))
    assert report == Report("stop", 16, 0.0, 0.0, Route.LOCAL)


def test_report_is_a_value_adding_returns_a_new_one() -> None:
    empty = Report()
    assert empty.add(Transferred(1.0)) is not empty
    assert empty == Report()


def test_an_end_without_a_worker_keeps_the_last_route() -> None:
    report = Report().add(Ended("stop", Route.LOCAL)).add(Ended("length"))
    assert report == Report("length", route=Route.LOCAL)
