"""Poison-prompt strikes (router/quarantine.py): exact counts, distinct workers, expiry, bounds."""

from __future__ import annotations

from router.quarantine import POISON_STRIKES, Quarantine, prompt_digest


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_second_worker_lost_quarantines_until_the_strikes_expire() -> None:
    clock = Clock()
    q = Quarantine(quarantine_s=60.0, clock=clock)
    d = prompt_digest([1, 2, 3])
    assert q.strikes(d) == 0 and not q.quarantined(d)
    assert q.strike(d, "w1") == 1 and not q.quarantined(d)
    clock.now += 59.0
    assert q.strike(d, "w2") == POISON_STRIKES == 2 and q.quarantined(d)
    clock.now += 59.0  # the second strike renewed the expiry
    assert q.quarantined(d)
    clock.now += 1.0
    assert q.strikes(d) == 0 and not q.quarantined(d)
    assert q.strike(d, "w3") == 1


def test_one_worker_lost_by_several_requests_is_one_strike() -> None:
    """n choices of one prompt, or a popular prompt, on the worker that died."""
    q = Quarantine(quarantine_s=60.0, clock=Clock())
    d = prompt_digest([9, 9])
    assert q.strike(d, "w1") == 1
    assert q.strike(d, "w1") == 1 and not q.quarantined(d)


def test_a_strike_expires_alone() -> None:
    clock = Clock()
    q = Quarantine(quarantine_s=10.0, clock=clock)
    d = prompt_digest([5])
    q.strike(d, "w1")
    clock.now += 10.0
    assert q.strike(d, "w2") == 1


def test_digests_differ_by_prompt_and_the_table_is_bounded() -> None:
    assert prompt_digest([1, 2]) != prompt_digest([2, 1])
    assert prompt_digest([1, 2]) == prompt_digest((1, 2))
    assert prompt_digest([1]) != prompt_digest([1, 0])
    q = Quarantine(quarantine_s=60.0, max_prompts=3, clock=Clock())
    digests = [prompt_digest([i]) for i in range(5)]
    for d in digests:
        q.strike(d, "w1")
    assert [q.strikes(d) for d in digests] == [0, 0, 1, 1, 1]  # the oldest went first
