"""Poison-request strikes (router/quarantine.py): exact counts, distinct workers, a condemned
request, expiry, digests per caller, prompt and sampling, bounds."""

from __future__ import annotations

import dataclasses

from engine.sampling_params import SamplingParams
from router.quarantine import POISON_STRIKES, Quarantine, request_digest
from router.request_core import peer_host

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _digest(prompt: list[int], caller: str = "host:10.0.0.1") -> str:
    return request_digest(caller, prompt, PARAMS)


def test_a_second_worker_lost_quarantines_until_the_strikes_expire() -> None:
    clock = Clock()
    q = Quarantine(quarantine_s=60.0, clock=clock)
    d = _digest([1, 2, 3])
    assert q.strikes(d) == 0 and not q.quarantined(d)
    assert q.strike(d, "w1") == 1 and not q.quarantined(d)
    clock.now += 59.0
    assert q.strike(d, "w2") == POISON_STRIKES == 2 and q.quarantined(d)
    clock.now += 59.0  # the second strike renewed the expiry
    assert q.quarantined(d)
    clock.now += 1.0
    assert q.strikes(d) == 0 and not q.quarantined(d)
    assert q.strike(d, "w3") == 1


def test_a_condemned_request_is_quarantined_at_once_for_quarantine_s() -> None:
    clock = Clock()
    q = Quarantine(quarantine_s=60.0, clock=clock)
    d = _digest([4, 4])
    q.condemn(d, "w1")
    assert q.quarantined(d) and q.strikes(d) == 1
    clock.now += 59.9
    assert q.quarantined(d)
    clock.now += 0.1
    assert not q.quarantined(d) and q.strikes(d) == 0


def test_one_worker_lost_by_several_requests_is_one_strike() -> None:
    """Identical choices of one request on the worker that died."""
    q = Quarantine(quarantine_s=60.0, clock=Clock())
    d = _digest([9, 9])
    assert q.strike(d, "w1") == 1
    assert q.strike(d, "w1") == 1 and not q.quarantined(d)


def test_a_strike_expires_alone() -> None:
    clock = Clock()
    q = Quarantine(quarantine_s=10.0, clock=clock)
    d = _digest([5])
    q.strike(d, "w1")
    clock.now += 10.0
    assert q.strike(d, "w2") == 1


def test_strikes_are_one_callers_prompt_with_its_sampling_never_anyone_elses() -> None:
    base = _digest([1, 2])
    assert base == request_digest("host:10.0.0.1", (1, 2), PARAMS)
    others = [
        _digest([2, 1]),
        _digest([1]),
        _digest([1, 2, 0]),
        _digest([1, 2], caller="host:10.0.0.2"),
        _digest([1, 2], caller="key:ab12"),
        request_digest("host:10.0.0.1", [1, 2], dataclasses.replace(PARAMS, seed=1)),
        request_digest("host:10.0.0.1", [1, 2], dataclasses.replace(PARAMS, max_tokens=9)),
    ]
    assert len({base, *others}) == 1 + len(others)
    q = Quarantine(quarantine_s=60.0, clock=Clock())
    q.strike(base, "w1")
    q.strike(base, "w2")
    assert q.quarantined(base) and not any(q.quarantined(d) for d in others)


def test_the_table_is_bounded_oldest_first() -> None:
    q = Quarantine(quarantine_s=60.0, max_requests=3, clock=Clock())
    digests = [_digest([i]) for i in range(5)]
    for d in digests:
        q.strike(d, "w1")
    assert [q.strikes(d) for d in digests] == [0, 0, 1, 1, 1]  # the oldest went first


def test_a_peers_host_is_its_address_less_the_port() -> None:
    assert peer_host("ipv4:10.0.0.7:5123") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:5123") == "::1"
    assert peer_host("ipv6:[2001:db8::2]:80") == "2001:db8::2"
    assert peer_host("unix:/tmp/router.sock") == "unix:/tmp/router.sock"
    assert peer_host("192.168.1.4") == "192.168.1.4"  # an HTTP client's host, as given
