"""The router's waiting room (the shell of flow control) on a scripted clock: who goes to the
workers when, what a refusal carries, what a client that leaves takes with it; the rate it
measures (exact values); the classes, the config and the API key attributes it reads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.common.auth import ApiKeys
from router.flow_config import FlowConfig
from router.prefill_rate import PrefillRate
from router.request_class import DEFAULT_CLASS, RequestClass, Slo, Tag, parse_classes
from router.ttft_fit import Correction
from router.waiting_room import TTL_EXPIRED, Seat, Shed, WaitingRoom

HIGH = RequestClass("high", priority=-1)
LOW = RequestClass("low", priority=5, max_queued=3)
LOW_OPEN = RequestClass("low_open", priority=5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _room(clock: Clock, workers: int = 1, **flow: object) -> WaitingRoom:
    config = FlowConfig(classes=(DEFAULT_CLASS, HIGH, LOW, LOW_OPEN), **flow)  # type: ignore[arg-type]
    return WaitingRoom(config, lambda: workers, clock)


async def _entered(room: WaitingRoom, rid: str, tag: Tag, cost: int) -> asyncio.Task[Seat]:
    """``rid`` entering, run until it waits (or is through)."""
    task = asyncio.create_task(room.enter(rid, tag, cost))
    for _ in range(3):
        await asyncio.sleep(0)  # the task runs to its first await: no time passes
    return task


def test_a_queued_high_priority_request_goes_before_earlier_low_ones() -> None:
    async def run() -> None:
        clock = Clock()
        room = _room(clock, inflight_tokens_per_worker=100)
        first = await _entered(room, "l1", Tag("a", LOW), 80)
        assert first.done()  # nothing in flight: it goes at once
        waiting = [await _entered(room, f"l{i}", Tag("a", LOW), 80) for i in (2, 3)]
        high = await _entered(room, "h", Tag("b", HIGH), 80)
        assert not any(t.done() for t in (*waiting, high))
        assert room.queues.waiting() == 3
        seat = first.result()
        clock.now += 0.5
        seat.first_token()  # 80 tokens back: room for the next, and it is the high one
        await asyncio.sleep(0)
        assert high.done() and not any(t.done() for t in waiting)
        high.result().leave()  # an error before its first token: its tokens back, unmeasured
        await asyncio.sleep(0)
        assert waiting[0].done() and not waiting[1].done()
        waiting[0].result().leave()
        waiting[1].cancel()  # its client left while it waited
        await asyncio.gather(waiting[1], return_exceptions=True)
        assert len(room.queues) == 0 and room.rate.inflight_tokens == 0

    asyncio.run(run())


def test_a_full_class_queue_and_an_unreachable_target_are_refused_at_once() -> None:
    async def run() -> None:
        clock = Clock()
        room = _room(clock, inflight_tokens_per_worker=1, prefill_tokens_per_s=1000.0)
        first = await _entered(room, "r0", Tag("a", LOW), 500)
        tasks = [await _entered(room, f"r{i}", Tag("a", LOW), 500) for i in (1, 2, 3)]
        with pytest.raises(Shed) as full:
            await room.enter("r4", Tag("a", LOW), 500)
        assert full.value.reason == "queue_full" and not full.value.unavailable
        # The work ahead: 500 in flight and 1500 waiting at the prior rate (1000 tokens/s over
        # 1 s, nothing measured): 2 s to drain.
        assert full.value.retry_after_s == 2
        assert "class 'low' has 3 requests waiting" in str(full.value)
        # A target of 1 s in the same band, another key: 500 in flight, its own 500, and of
        # key a's 1500 waiting the one turn (512 tokens) it waits for: 1.512 s.
        with pytest.raises(Shed) as missed:
            await room.enter("r5", Tag("b", LOW_OPEN, slo=Slo(ttft_s=1.0)), 500)
        assert missed.value.reason == "slo_unreachable"
        assert missed.value.retry_after_s == 1  # ceil(1.512 - 1.0)
        assert "predicted time to first token 1.512 s misses its target 1 s" in str(missed.value)
        for task in (first, *tasks):
            task.cancel()
        await asyncio.gather(first, *tasks, return_exceptions=True)

    asyncio.run(run())


def test_no_worker_is_a_503_and_a_request_past_its_ttl_is_shed() -> None:
    async def run() -> None:
        clock = Clock()
        with pytest.raises(Shed) as none:
            await _room(clock, workers=0).enter("r", Tag("a"), 10)
        assert none.value.unavailable and none.value.reason == "no_worker"
        short = RequestClass("short", queue_ttl_s=0.05)
        config = FlowConfig(classes=(DEFAULT_CLASS, short), inflight_tokens_per_worker=1)
        room = WaitingRoom(config, lambda: 1)  # the real clock: its timer sheds it
        first = await room.enter("r0", Tag("a", short), 10)
        with pytest.raises(Shed) as expired:
            async with asyncio.timeout(30):  # a bound, far past the TTL
                await room.enter("r1", Tag("a", short), 10)
        assert expired.value.reason == TTL_EXPIRED and expired.value.retry_after_s >= 1
        assert "its class 'short''s queue_ttl_s (0.05)" in str(expired.value)
        first.leave()
        assert len(room.queues) == 0 and room.rate.inflight_tokens == 0

    asyncio.run(run())


def test_a_client_that_leaves_while_waiting_leaves_the_queue() -> None:
    async def run() -> None:
        room = _room(Clock(), inflight_tokens_per_worker=1)
        first = await room.enter("r0", Tag("a"), 10)
        gone = await _entered(room, "r1", Tag("a"), 10)
        assert "r1" in room.queues
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert "r1" not in room.queues
        first.first_token()
        assert room.rate.inflight_tokens == 0

    asyncio.run(run())


def test_the_running_bound_holds_requests_until_one_ends_not_until_its_first_token() -> None:
    async def run() -> None:
        room = _room(Clock(), workers=1, max_running_per_decode_worker=2)
        seats = [await room.enter(f"r{i}", Tag("a"), 10) for i in range(2)]
        third = await _entered(room, "r2", Tag("a"), 10)
        for seat in seats:
            seat.first_token()  # no prompt in flight now: the running bound holds it still
        await asyncio.sleep(0)
        assert not third.done()
        seats[0].leave()  # one ends: its place goes to the next
        await asyncio.sleep(0)
        assert third.done()
        for seat in (seats[1], third.result()):
            seat.leave()
        assert room._running == 0 and room.rate.inflight_tokens == 0

    asyncio.run(run())


def test_a_client_that_leaves_as_its_turn_comes_gives_its_tokens_back() -> None:
    """Cancelled, then released before its task resumes: it never went, nothing stays
    counted (else the leaked tokens would block every later release)."""

    async def run() -> None:
        room = _room(Clock(), inflight_tokens_per_worker=1)
        first = await room.enter("r0", Tag("a"), 10)
        gone = await _entered(room, "r1", Tag("a"), 10)
        gone.cancel()
        first.first_token()  # its turn comes before its cancellation runs
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(room.queues) == 0 and room.rate.inflight_tokens == 0
        after = await room.enter("r2", Tag("a"), 10)  # the room still serves
        after.leave()
        assert room.rate.inflight_tokens == 0

    asyncio.run(run())


def test_the_rate_is_measured_while_busy_and_the_prior_fades() -> None:
    rate = PrefillRate(prior_tokens_per_s=1000.0, half_life_s=1e9)  # no decay: exact sums
    assert rate.tokens_per_s(num_workers=2) == 2000.0  # the prior, per worker
    rate.sent(3000, now_s=0.0)
    rate.served(3000, now_s=1.0)  # 3000 tokens in 1 busy second
    assert rate.tokens_per_s(1) == pytest.approx((3000 + 1000) / (1 + 1), rel=1e-6)
    rate.sent(100, now_s=5.0)  # 4 idle seconds in between count for nothing
    rate.served(100, now_s=6.0)
    assert rate.tokens_per_s(1) == pytest.approx((3100 + 1000) / (2 + 1), rel=1e-6)
    rate.observe_overhead(first_token_s=0.5, work_tokens=0, num_workers=1)
    assert rate.overhead_s == pytest.approx(0.05)  # one tenth of the sample
    assert rate.inflight_tokens == 0
    for formula in (0.2, 0.6, 1.0, 1.4) * 2:  # chat's TTFT: half the formula's
        rate.observe_ttft("chat", formula, formula / 2)
    assert rate.correction("chat").slope == pytest.approx(0.5)
    assert rate.correction("batch") == Correction()  # each class its own


def test_the_work_in_flight_drains_as_a_virtual_queue() -> None:
    rate = PrefillRate(prior_tokens_per_s=1000.0, half_life_s=1e9)  # no decay: exact sums
    rate.sent(500, now_s=10.0)  # at the prior's 1000 tokens/s: done at 10.5 ...
    slow = (0 + 1000) / (0.2 + 1)  # busy 0.2 s, nothing served yet: the rate read at 10.2
    rate.sent(500, now_s=10.2)  # ... then this one, done at 10.5 + 500 / slow
    drain = 10.5 + 500 / slow
    # (abs=1: the busy seconds' decay integral rounds at 1e-9 s.)
    assert rate.pending_tokens(10.2, num_workers=1) == pytest.approx((drain - 10.2) * slow, abs=1)
    assert rate.pending_tokens(10.2, 1) < rate.inflight_tokens == 1000  # 300 of it done
    # The first's token back early, at 10.3: the second's drain is capped at its whole
    # compute from then, at the rate measured then.
    rate.served(500, now_s=10.3)
    fast = rate.tokens_per_s(1)
    assert fast == pytest.approx((500 + 1000) / (0.3 + 1))
    assert rate.pending_tokens(10.3, 1) == 500
    assert rate.pending_tokens(10.4, 1) == pytest.approx((10.3 + 500 / fast - 10.4) * fast, abs=1)
    assert rate.pending_tokens(20.0, 1) == 0  # late: none predicted (the fit corrects it)
    rate.dropped(500, now_s=20.0)
    assert rate.pending_tokens(20.0, 1) == 0 == rate.inflight_tokens


def test_classes_config_and_key_attributes_are_read_and_refused_by_name(tmp_path: Path) -> None:
    classes = parse_classes("interactive:priority=-1,ttft_s=0.5,tpot_s=0.05;batch:max_queued=8")
    assert [c.name for c in classes] == ["interactive", "batch", "default"]
    assert classes[0].priority == -1 and classes[0].slo == Slo(0.5, 0.05)
    assert classes[1].max_queued == 8 and classes[1].queue_ttl_s == 600.0
    with pytest.raises(ValueError, match=r"'x=1' is not one of priority=\.\.\."):
        parse_classes("a:x=1")
    with pytest.raises(ValueError, match="priority must be int, got 'high'"):
        parse_classes("a:priority=high")
    with pytest.raises(ValueError, match="named twice"):
        parse_classes("a;a")
    assert parse_classes("b:load_share=0.75")[0].load_share == 0.75
    with pytest.raises(ValueError, match=r"load_share must be in \(0, 1\], got 1.5"):
        parse_classes("b:load_share=1.5")
    with pytest.raises(ValueError, match="ttft_s must be in"):
        parse_classes("a:ttft_s=0")
    with pytest.raises(ValueError, match="default_class 'vip' is not one of"):
        FlowConfig(default_class="vip")
    with pytest.raises(ValueError, match="fairness_header must be a lower-case header name"):
        FlowConfig(fairness_header="authorization")
    keys = tmp_path / "keys"
    keys.write_text("sk-one class=batch weight=2\nsk-two\n")
    api = ApiKeys(keys)
    assert api.attributes("Bearer sk-one") == {"class": "batch", "weight": "2"}
    assert api.attributes("Bearer sk-two") == {} == api.attributes("Bearer sk-none")
    keys.write_text("sk-one weight\n")
    with pytest.raises(ValueError, match=r"key 1: 'weight' is not name=value"):
        ApiKeys(keys)
