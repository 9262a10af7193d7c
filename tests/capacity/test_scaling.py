"""The autoscaler's arithmetic and policy, with exact values (app/capacity/scaling.py)."""

from __future__ import annotations

import dataclasses

import pytest

from app.capacity.profile import DECODE_FEATURES, PREFILL_FEATURES, LinearFit
from app.capacity.scaling import (
    Bounds,
    Corrections,
    Load,
    PoolState,
    Reason,
    ScalingPolicy,
    Signal,
    correction,
    decide,
    decode_seats,
    desired_replicas,
    predict,
    prefill_tokens_per_s,
    pressure_replicas,
    wanted_replicas,
)
from pdserve.common.role import Role
from tests.capacity.test_simulator import constant_profile

PROFILE = dataclasses.replace(
    constant_profile(prefill_s=0.01, decode_s=0.01, max_num_seqs=64),
    prefill=LinearFit(PREFILL_FEATURES, 0.01, (1e-4, 0.0)),
    decode=LinearFit(DECODE_FEATURES, 0.01, (1e-3, 0.0)),
)
POLICY = ScalingPolicy(slo_ttft_s=1.0, slo_tpot_s=0.05)


def _load(rate: float, t: float = 0.0) -> Load:
    return Load(t, rate, mean_prompt_tokens=512, mean_output_tokens=64)


def test_capacity_formulas() -> None:
    # A full 2048-token step: 0.01 + 2048e-4 = 0.2148 s.
    assert prefill_tokens_per_s(PROFILE, 512) == pytest.approx(2048 / 0.2148)
    # 0.01 + 0.001 B <= 0.05 allows 40 seats; 36 blocks a request in 1024 blocks allow 28.
    assert decode_seats(PROFILE, _load(10), 0.05) == 28
    assert decode_seats(PROFILE, _load(10), 0.03) == 20  # the SLO binds first
    assert decode_seats(PROFILE, _load(10), 0.005) == 0
    # rate 10: 5120 prompt tokens/s over 0.8 x 9534 -> 1; 10 x 64 x 0.038 = 24.3 busy seats
    # over 0.8 x 28 -> 2.
    assert desired_replicas(PROFILE, _load(10), POLICY, Corrections()) == {
        Role.PREFILL: 1,
        Role.DECODE: 2,
    }
    assert desired_replicas(PROFILE, _load(40), POLICY, Corrections()) == {
        Role.PREFILL: 3,
        Role.DECODE: 5,
    }
    # Observed latency twice the profile's: prefill throughput halves (3 -> 6 at rate 40).
    slower = desired_replicas(PROFILE, _load(40), POLICY, Corrections(prefill=2.0))
    assert slower[Role.PREFILL] == 6
    assert desired_replicas(PROFILE, _load(0), POLICY, Corrections()) == {
        Role.PREFILL: 0,
        Role.DECODE: 0,
    }


def test_prediction_and_correction() -> None:
    assert predict([_load(1), _load(2), _load(3)]).rate == pytest.approx(4.0)
    assert predict([_load(2)]).rate == 2.0
    assert predict([_load(5), _load(1)]).rate == 0.0  # falling fast: never below 0
    assert predict([_load(r) for r in (9, 1, 2, 3, 4)]).rate == pytest.approx(5.0)  # last 4
    assert correction(0.2, 0.1) == pytest.approx(2.0)
    assert correction(1.0, 0.1) == 4.0 and correction(0.001, 0.1) == 0.25
    assert correction(None, 0.1) == 1.0
    with pytest.raises(ValueError):
        predict([])


def test_decide_scales_up_at_once_and_down_after_hysteresis_and_cooldown() -> None:
    state = PoolState(2)
    decision, state = decide(Role.DECODE, state, 5, 0.0, POLICY)
    assert (decision.target, decision.reason) == (5, Reason.UP)
    reasons = []
    for t in (30.0, 60.0, 90.0, 120.0):
        decision, state = decide(Role.DECODE, state, 2, t, POLICY)
        reasons.append((decision.target, decision.reason))
    assert reasons == [
        (5, Reason.HYSTERESIS),
        (5, Reason.HYSTERESIS),
        (5, Reason.COOLDOWN),  # below for 3 intervals, but 90 s < 120 s since the change
        (2, Reason.DOWN),
    ]
    assert state == PoolState(2, 120.0, 0)
    # Bounds: never above max (8), never below min (1); a capped pool says why.
    decision, state = decide(Role.DECODE, PoolState(3), 20, 0.0, POLICY)
    assert (decision.target, decision.reason) == (8, Reason.UP)
    decision, state = decide(Role.DECODE, state, 20, 30.0, POLICY)
    assert (decision.target, decision.reason) == (8, Reason.BOUNDS)
    floor = ScalingPolicy(1.0, 0.05, prefill=Bounds(1, 4), down_after_intervals=1, cooldown_s=0)
    decision, _ = decide(Role.PREFILL, PoolState(2), 0, 10.0, floor)
    assert (decision.desired, decision.target, decision.reason) == (1, 1, Reason.DOWN)
    # Back at the desired size: the below-count restarts.
    decision, state = decide(Role.DECODE, PoolState(4, None, 2), 4, 0.0, POLICY)
    assert decision.reason is Reason.STEADY and state.num_below == 0
    with pytest.raises(ValueError):
        Bounds(3, 2)


def test_pool_pressure_floors_the_loads_sizes_and_names_its_signal() -> None:
    pressed = dataclasses.replace(_load(1.0), decode_kv_usage=0.9, prefill_queue_depth=40)
    current = {Role.PREFILL: 1, Role.DECODE: 3}
    # Decode: ceil(3 x 0.9 / 0.75) = 4. Prefill: 40 x 512 tokens at 2048 / 0.2148 tokens/s
    # a worker, drained within the 1 s TTFT SLO: ceil(2.148) = 3.
    by_pressure = pressure_replicas(PROFILE, pressed, POLICY, Corrections(), current)
    assert by_pressure == {
        Role.DECODE: (4, Signal.KV_PRESSURE),
        Role.PREFILL: (3, Signal.QUEUE),
    }
    # A slower prefill than profiled (correction 2) needs twice the workers: ceil(4.297).
    slow = pressure_replicas(PROFILE, pressed, POLICY, Corrections(prefill=2.0), current)
    assert slow[Role.PREFILL] == (5, Signal.QUEUE)
    # Exactly at the target: no more workers (3 x 0.75 / 0.75 = 3, not 4).
    at_target = dataclasses.replace(pressed, decode_kv_usage=0.75)
    at = pressure_replicas(PROFILE, at_target, POLICY, Corrections(), current)
    assert at[Role.DECODE] == (3, Signal.KV_PRESSURE)
    # Unreported pools ask for nothing.
    assert pressure_replicas(PROFILE, _load(1.0), POLICY, Corrections(), current) == {}
    wanted = wanted_replicas({Role.PREFILL: 4, Role.DECODE: 2}, by_pressure)
    assert wanted == {Role.PREFILL: (4, Signal.LOAD), Role.DECODE: (4, Signal.KV_PRESSURE)}
    tie = wanted_replicas({Role.PREFILL: 3, Role.DECODE: 4}, by_pressure)
    assert tie == {Role.PREFILL: (3, Signal.LOAD), Role.DECODE: (4, Signal.LOAD)}
    with pytest.raises(ValueError, match="kv_target"):
        ScalingPolicy(slo_ttft_s=1.0, slo_tpot_s=0.05, kv_target=0.0)


def test_missed_targets_grow_the_pool_they_depend_on_and_name_it() -> None:
    current = {Role.PREFILL: 2, Role.DECODE: 3}
    # 80 % of TTFT targets met (shed ones counted as misses) against 95 %: prefill grows to
    # ceil(2 x 0.95 / 0.8) = 3; TPOT met 94 %: decode ceil(3 x 0.95 / 0.94) = 4 (one more).
    missed = dataclasses.replace(_load(1.0), ttft_attainment=0.8, tpot_attainment=0.94)
    wanted = pressure_replicas(PROFILE, missed, POLICY, Corrections(), current)
    assert wanted == {Role.PREFILL: (3, Signal.TTFT_SLO), Role.DECODE: (4, Signal.TPOT_SLO)}
    # A collapse (10 % met) at most doubles a pool per interval; met, or nothing measured,
    # asks for nothing; the larger of KV pressure and TPOT misses wins, and is named.
    collapse = dataclasses.replace(missed, ttft_attainment=0.1, tpot_attainment=None)
    assert pressure_replicas(PROFILE, collapse, POLICY, Corrections(), current) == {
        Role.PREFILL: (4, Signal.TTFT_SLO)
    }
    met = dataclasses.replace(missed, ttft_attainment=0.95, tpot_attainment=1.0)
    assert pressure_replicas(PROFILE, met, POLICY, Corrections(), current) == {}
    both = dataclasses.replace(met, decode_kv_usage=1.0, tpot_attainment=0.5)
    assert pressure_replicas(PROFILE, both, POLICY, Corrections(), current) == {
        Role.DECODE: (6, Signal.TPOT_SLO)  # min(2 x 3, ceil(3 x 0.95 / 0.5)) over 4 by KV
    }
    no_prefill = {Role.PREFILL: 0, Role.DECODE: 3}  # colocated: the load sizes prefill
    assert Role.PREFILL not in pressure_replicas(PROFILE, missed, POLICY, Corrections(), no_prefill)
    with pytest.raises(ValueError, match="slo_attainment"):
        ScalingPolicy(slo_ttft_s=1.0, slo_tpot_s=0.05, slo_attainment=0.0)
