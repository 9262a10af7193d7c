"""``engine/step_progress.py`` and the router's rule on it (``router.policy.engine_stalled``):
exact values at given clock readings."""

from __future__ import annotations

import time

from engine.step_progress import StepProgress
from router.policy import engine_stalled


def test_an_idle_engine_is_never_stalled() -> None:
    progress = StepProgress()
    assert progress.stalled_s(now=time.monotonic() + 1e6) == 0.0
    progress.working()
    progress.progressed(stepped=False)  # found nothing to run: waits, idle
    assert progress.stalled_s(now=time.monotonic() + 1e6) == 0.0
    assert progress.num_steps == 0


def test_stalled_counts_from_the_start_of_work_until_a_step_completes() -> None:
    progress = StepProgress()
    before = time.monotonic()
    progress.working()
    after = time.monotonic()
    assert 100.0 <= progress.stalled_s(now=after + 100.0) <= 100.0 + (after - before)
    progress.working()  # still the same wait: the clock does not restart
    assert progress.stalled_s(now=after + 100.0) >= 100.0
    progress.progressed(stepped=True)
    assert progress.stalled_s(now=after + 100.0) == 0.0
    assert progress.num_steps == 1


def test_the_router_gives_up_at_its_stall_timeout_not_before() -> None:
    assert not engine_stalled(0.0, 30.0)
    assert not engine_stalled(29.999, 30.0)
    assert engine_stalled(30.0, 30.0)
    assert engine_stalled(31.0, 30.0)
