"""The router's waiting room and admission, pure: exact orders and decisions for scripted
queues (bands, fairness shares by prompt tokens, time to live, the release bound, the TTFT
prediction against its target, Retry-After)."""

from __future__ import annotations

import pytest

from engine.sampling_params import MAX_PRIORITY, InvalidField
from router.admission import PoolRate, Verdict, admit
from router.flow_control import FlowQueues, Ticket
from router.request_class import RequestClass, Slo, Tag
from router.ttft_fit import Correction, TtftFit


def _ticket(
    rid: str, key: str = "a", band: int = 0, cost: int = 100, arrival: float = 0.0
) -> Ticket:
    return Ticket(rid, key, band, cost, arrival, arrival + 10.0)


def _drain(queues: FlowQueues) -> list[str]:
    order = []
    while (ticket := queues.pop()) is not None:
        order.append(ticket.request_id)
    return order


def test_a_more_urgent_band_is_served_first_whatever_its_arrival() -> None:
    queues = FlowQueues(quantum_tokens=100)
    for rid, band in (("low1", 5), ("high1", 0), ("low2", 5), ("mid", 2), ("high2", 0)):
        queues.push(_ticket(rid, band=band))
    assert _drain(queues) == ["high1", "high2", "mid", "low1", "low2"]
    assert len(queues) == 0 and queues.pop() is None


def test_keys_of_a_band_take_turns_a_flood_gets_its_share_not_the_band() -> None:
    queues = FlowQueues(quantum_tokens=100)
    for i in range(5):
        queues.push(_ticket(f"A{i}", key="flood"))
    queues.push(_ticket("B0", key="modest"))
    queues.push(_ticket("B1", key="modest"))
    assert _drain(queues) == ["A0", "B0", "A1", "B1", "A2", "A3", "A4"]


def test_shares_are_by_prompt_tokens_and_weights() -> None:
    # 300-token requests against 100-token ones: three of the small per large one.
    queues = FlowQueues(quantum_tokens=100)
    for i in range(2):
        queues.push(_ticket(f"L{i}", key="large", cost=300))
    for i in range(6):
        queues.push(_ticket(f"S{i}", key="small", cost=100))
    assert _drain(queues) == ["S0", "S1", "L0", "S2", "S3", "S4", "L1", "S5"]
    # Weight 2 against 1: two requests per turn against one.
    queues = FlowQueues(quantum_tokens=100, weights={"gold": 2.0})
    for i in range(4):
        queues.push(_ticket(f"G{i}", key="gold"))
        queues.push(_ticket(f"P{i}", key="plain"))
    assert _drain(queues) == ["G0", "G1", "P0", "G2", "G3", "P1", "P2", "P3"]


def test_an_idle_key_keeps_no_credit_and_a_new_key_joins_the_turns_last() -> None:
    queues = FlowQueues(quantum_tokens=250)
    queues.push(_ticket("A0", key="a"))
    assert _drain(queues) == ["A0"]  # a's 150 left over go with its empty queue
    for rid, key in (("A1", "a"), ("A2", "a"), ("A3", "a"), ("B0", "b")):
        queues.push(_ticket(rid, key=key))
    assert _drain(queues) == ["A1", "A2", "B0", "A3"]


def test_release_sheds_what_waited_past_its_time_then_fills_the_inflight_bound() -> None:
    queues = FlowQueues(quantum_tokens=1000)
    queues.push(Ticket("old", "a", 0, 100, 0.0, 5.0))
    queues.push(Ticket("late-low", "a", 3, 100, 1.0, 6.0))
    for i in range(4):
        queues.push(Ticket(f"r{i}", "a", 0, 100, 2.0, 20.0))
    release = queues.release(now_s=6.0, inflight_tokens=50, max_inflight_tokens=300)
    assert [t.request_id for t in release.shed] == ["old", "late-low"]
    assert [t.request_id for t in release.dispatch] == ["r0", "r1"]  # 50 + 200 <= 300
    assert queues.release(6.0, 300, 300).dispatch == ()
    # Nothing in flight: one goes even past the bound (it could never go otherwise).
    queues.push(Ticket("huge", "b", 0, 5000, 6.0, 60.0))
    release = queues.release(7.0, 0, 300)
    assert [t.request_id for t in release.dispatch] == ["r2", "r3"]
    assert [t.request_id for t in queues.release(7.0, 0, 300).dispatch] == ["huge"]


def test_release_also_stops_at_the_running_bound() -> None:
    queues = FlowQueues(quantum_tokens=1000)
    for i in range(4):
        queues.push(Ticket(f"r{i}", "a", 0, 100, 0.0, 20.0))
    release = queues.release(1.0, 0, 10_000, running=1, max_running=3)
    assert [t.request_id for t in release.dispatch] == ["r0", "r1"]  # 1 + 2 running = 3
    assert queues.release(1.0, 0, 10_000, running=3, max_running=3).dispatch == ()
    assert len(queues.release(1.0, 0, 10_000, running=3, max_running=0).dispatch) == 2  # none


def test_a_class_with_a_load_share_leaves_the_rest_of_each_bound_to_the_others() -> None:
    queues = FlowQueues(quantum_tokens=1000)
    for i in range(3):
        queues.push(Ticket(f"b{i}", "flood", 5, 100, 0.0, 20.0, share=0.5))
    # Running bound 8 x 0.5: batch goes while fewer than 4 run; tokens 400 x 0.5 = 200.
    release = queues.release(1.0, 0, 400, running=2, max_running=8)
    assert [t.request_id for t in release.dispatch] == ["b0", "b1"]  # 200 tokens in flight
    assert queues.release(1.0, 150, 400, running=3, max_running=8).dispatch == ()  # 250 > 200
    queues.push(Ticket("i0", "modest", -1, 100, 1.0, 20.0))  # share 1: the whole bound
    release = queues.release(1.0, 200, 400, running=4, max_running=8)
    assert [t.request_id for t in release.dispatch] == ["i0"]  # b2 still waits: 4 run
    # With nothing in flight one goes, and a share never bounds running below one.
    assert [t.request_id for t in queues.release(2.0, 0, 400, 0, 1).dispatch] == ["b2"]
    with pytest.raises(ValueError, match=r"share is in \(0, 1\]"):
        Ticket("x", "a", 0, 1, 0.0, 1.0, share=0.0)


def test_a_request_whose_client_left_leaves_the_queue() -> None:
    queues = FlowQueues(quantum_tokens=100)
    for rid, key in (("a0", "a"), ("b0", "b"), ("a1", "a")):
        queues.push(_ticket(rid, key=key))
    assert queues.remove("b0") is not None and queues.remove("b0") is None
    assert "b0" not in queues and queues.waiting(0) == 2
    assert _drain(queues) == ["a0", "a1"]
    with pytest.raises(ValueError, match="request 'x' is already waiting"):
        queues.push(_ticket("x"))
        queues.push(_ticket("x"))
    # Back under the same id with a later deadline: the first one's does not shed it.
    queues.remove("x")
    queues.push(_ticket("x", arrival=10.0))
    assert queues.release(now_s=12.0, inflight_tokens=100, max_inflight_tokens=100).shed == ()
    assert [t.request_id for t in queues.release(20.0, 100, 100).shed] == ["x"]


def test_tokens_ahead_counts_urgent_bands_its_own_queue_and_the_others_share() -> None:
    queues = FlowQueues(quantum_tokens=100, weights={"b": 0.5})
    queues.push(_ticket("u", key="z", band=0, cost=700))  # more urgent: all of it
    queues.push(_ticket("a0", key="a", band=1, cost=200))  # its own key: all of it
    queues.push(_ticket("b0", key="b", band=1, cost=1000))  # half its pace: (200+100)/2
    queues.push(_ticket("c0", key="c", band=1, cost=50))  # less than its share: all of it
    queues.push(_ticket("low", key="a", band=9, cost=5000))  # less urgent: none
    assert queues.tokens_ahead(band=1, key="a", cost=100) == 700 + 200 + 150 + 50
    assert queues.tokens_ahead(band=4, key="a", cost=100) == 700 + 200 + 1000 + 50
    assert queues.tokens_ahead(band=0, key="new", cost=100) == 0 + 100  # z: min(700, 100)


RATE = PoolRate(prefill_tokens_per_s=1000.0, overhead_s=0.05, backlog_tokens=500, num_workers=2)
INTERACTIVE = RequestClass("interactive", priority=0, slo=Slo(ttft_s=1.0), max_queued=3)


def test_admission_predicts_the_ttft_and_admits_what_meets_its_target() -> None:
    decision = admit(
        Tag("t1", INTERACTIVE), cost=200, tokens_ahead=100, queued_in_class=0, rate=RATE
    )
    assert decision.verdict is Verdict.ADMIT and decision.retry_after_s == 0
    assert decision.predicted_ttft_s == pytest.approx(0.05 + (500 + 100 + 200) / 1000)


def test_a_request_that_would_miss_its_target_is_refused_with_the_time_to_drain() -> None:
    decision = admit(Tag("t1", INTERACTIVE), 200, 2300, 0, RATE)
    assert decision.verdict is Verdict.SLO_UNREACHABLE and decision.verdict.http_status == 429
    assert decision.predicted_ttft_s == pytest.approx(3.05)
    assert decision.retry_after_s == 3  # ceil(3.05 - 1.0)
    assert "predicted time to first token 3.050 s misses its target 1 s" in decision.reason
    # Its own, looser target (over the class's) admits it.
    assert admit(Tag("t1", INTERACTIVE, slo=Slo(ttft_s=5.0)), 200, 2300, 0, RATE).admitted
    # No target: the queue's bound alone decides.
    assert admit(Tag("t1", RequestClass("batch")), 200, 10**6, 0, RATE).admitted
    # Nothing ahead (no backlog, no queue): admitted though 3.05 s misses 1 s, since going
    # now is the best it can get.
    idle = PoolRate(100.0, 0.05, backlog_tokens=0, num_workers=1)
    decision = admit(Tag("t1", INTERACTIVE), 300, 0, 0, idle)
    assert decision.admitted and decision.predicted_ttft_s == pytest.approx(3.05)
    # The class's measured fit corrects the formula: 0.2 s + 0.25 x 3.05 s meets 1 s (and
    # the formula's own value is kept, for the fit to learn from).
    fitted = PoolRate(1000.0, 0.05, 500, 2, correction=Correction(0.2, 0.25))
    decision = admit(Tag("t1", INTERACTIVE), 200, 2300, 0, fitted)
    assert decision.admitted and decision.predicted_ttft_s == pytest.approx(0.9625)
    assert decision.formula_ttft_s == pytest.approx(3.05)
    with pytest.raises(ValueError, match="slope must be in"):
        Correction(0.0, 5.0)


def test_a_full_queue_sheds_and_no_worker_is_503() -> None:
    decision = admit(Tag("t1", INTERACTIVE), 200, 1000, 3, RATE)
    assert decision.verdict is Verdict.QUEUE_FULL
    assert decision.retry_after_s == 2  # ceil((500 + 1000) / 1000)
    assert "class 'interactive' has 3 requests waiting (its max_queued)" in decision.reason
    quiet = PoolRate(1000.0, 0.05, 0, 0)
    decision = admit(Tag("t1", INTERACTIVE), 200, 0, 0, quiet)
    assert decision.verdict is Verdict.NO_WORKER and decision.verdict.http_status == 503
    assert decision.retry_after_s == 1


def test_a_tag_serves_at_its_own_priority_and_bad_values_are_named() -> None:
    tag = Tag("k", INTERACTIVE, priority=-3, slo=Slo(tpot_s=0.2))
    assert tag.band == -3 and tag.targets == Slo(ttft_s=1.0, tpot_s=0.2)
    assert Tag("k", INTERACTIVE).band == 0
    with pytest.raises(InvalidField, match="priority must be an integer in") as refused:
        Tag("k", priority=MAX_PRIORITY + 1)
    assert refused.value.field == "priority"
    with pytest.raises(InvalidField, match=r"ttft_s must be in \(0, 3600\] seconds, got 0"):
        Slo(ttft_s=0)
    with pytest.raises(ValueError, match="a class name is letters, digits"):
        RequestClass("a b")


def test_rounds_in_which_nothing_fits_are_given_at_once_in_the_same_order() -> None:
    # Quantum 1: 999 rounds pass before any request fits; the order is round robin's.
    queues = FlowQueues(quantum_tokens=1)
    queues.push(_ticket("A", key="a", cost=1000))
    queues.push(_ticket("B", key="b", cost=999))
    queues.push(_ticket("C", key="c", cost=5000))
    assert _drain(queues) == ["B", "A", "C"]
    with pytest.raises(ValueError, match=r"the weight of 'x' must be in \[0.015625, 64.0\]"):
        FlowQueues(weights={"x": float("inf")})
    weighted = FlowQueues(weights={"gold": 2.0})
    weighted.set_weight("gold", None)  # its key line lost its weight: back to 1
    assert weighted.weight("gold") == 1.0 and weighted.weights == {}


def test_the_deadline_heap_stays_bounded_by_what_waits() -> None:
    queues = FlowQueues(quantum_tokens=100)
    for i in range(1000):
        queues.push(Ticket(f"r{i}", "a", 0, 100, float(i), float(i) + 3600.0))
        assert queues.pop() is not None
    assert len(queues) == 0 and len(queues._deadlines) <= 2 * len(queues) + 65


def test_a_rate_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="overhead_s must be finite and >= 0, got nan"):
        PoolRate(1000.0, float("nan"), 0, 1)
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be finite and > 0"):
        PoolRate(float("inf"), 0.0, 0, 1)


def test_the_ttft_fit_is_a_line_once_it_has_samples() -> None:
    fit = TtftFit()
    for formula in (0.1, 0.5) * 3:
        fit.observe(formula, 0.12)
    assert fit.correction() == Correction()  # 6 samples: the identity still
    for formula in (0.1, 0.5):
        fit.observe(formula, 0.12)
    # A TTFT that does not follow the formula (an urgent class): flat at 0.12 s.
    line = fit.correction()
    assert line.slope == pytest.approx(0.0, abs=1e-9)
    assert line.intercept_s == pytest.approx(0.12)
    steady = TtftFit()
    for measured in (0.2, 0.4) * 4:
        steady.observe(0.5, measured)  # one formula value: a ratio through zero
    ratio = steady.correction()
    assert ratio.intercept_s == 0.0 and 0.5 < ratio.slope < 0.7
    follows = TtftFit()
    for formula in (0.1, 0.2, 0.3, 0.4) * 2:
        follows.observe(formula, 0.05 + 2 * formula)
    assert follows.correction().slope == pytest.approx(2.0)
    assert follows.correction().intercept_s == pytest.approx(0.05)
