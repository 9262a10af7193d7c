"""``pdserve autoscale``'s control loop: every ``interval_s`` it reads the routers' totals,
turns the interval into a load, predicts the next one, corrects the profile by the latency it
observes, decides each pool's size (``scaling.py``, pure) and applies changes to a
``ScaleTarget``. Every decision is logged and exported as metrics."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from app.capacity.load_meter import PoolPressure, Totals, load_between
from app.capacity.profile import Profile
from app.capacity.scale_target import ScaleTarget
from app.capacity.scaling import (
    Corrections,
    Decision,
    Load,
    PoolState,
    ScalingPolicy,
    corrections_for,
    decide,
    desired_replicas,
    predict,
    pressure_replicas,
    wanted_replicas,
)
from pdserve.common.role import WORKER_ROLES, Role

logger = logging.getLogger(__name__)

DESIRED = Gauge("pdserve_planner_desired_replicas", "What the load wants, bounded", ["pool"])
ACTUAL = Gauge("pdserve_planner_replicas", "The pool's size as set", ["pool"])
PREDICTED_RATE = Gauge("pdserve_planner_predicted_rate", "Next interval's requests/s")
CORRECTION = Gauge("pdserve_planner_correction", "Observed / expected latency", ["pool"])
DECISIONS = Counter("pdserve_planner_decisions_total", "Decisions", ["pool", "reason"])
SIGNALS = Counter(
    "pdserve_planner_signals_total",
    "Decisions by the signal that set the wanted size (load, kv_pressure, queued_prompt_tokens)",
    ["pool", "signal"],
)
FAILED_ROUNDS = Counter(
    "pdserve_planner_failed_rounds_total",
    "Autoscale rounds that decided nothing (an input unreadable or not a number); logged",
)
KV_USAGE = Gauge("pdserve_planner_decode_kv_usage", "The decode pool's KV usage as read")
QUEUE_DEPTH = Gauge("pdserve_planner_prefill_queue_depth", "Requests queued on prefill as read")
_HISTORY = 8


class Autoscaler:
    def __init__(
        self,
        profile: Profile,
        policy: ScalingPolicy,
        meter: Callable[[float], dict[str, Totals]],  # each router's totals at a time
        target: ScaleTarget,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
        pressure: Callable[[], PoolPressure] | None = None,  # the pools' state, if known
    ) -> None:
        self.profile, self.policy, self.meter, self.target = profile, policy, meter, target
        self.dry_run, self.clock, self.pressure = dry_run, clock, pressure
        self.states = {pool: PoolState(target.replicas(pool)) for pool in WORKER_ROLES}
        self.history: list[Load] = []
        self._last: tuple[float, dict[str, Totals]] | None = None

    def tick(self) -> list[Decision]:
        """One interval: [] on the first call (there is no interval yet)."""
        now_s = self.clock()
        readings = self.meter(now_s)
        last, self._last = self._last, (now_s, readings)
        if last is None:
            return []
        previous = self.history[-1] if self.history else None
        load = load_between(last[1], readings, now_s - last[0], previous)
        if self.pressure is not None:
            pools = self.pressure()
            load = dataclasses.replace(
                load,
                decode_kv_usage=pools.decode_kv_usage,
                prefill_queue_depth=pools.prefill_queue_depth,
            )
            KV_USAGE.set(pools.decode_kv_usage or 0.0)
            QUEUE_DEPTH.set(pools.prefill_queue_depth or 0.0)
        self.history = [*self.history, load][-_HISTORY:]
        predicted = predict(self.history)
        corrections = (
            corrections_for(self.profile, load, max(1, self.states[Role.DECODE].replicas))
            if self.policy.correct_profile
            else Corrections()
        )
        by_load = desired_replicas(self.profile, predicted, self.policy, corrections)
        if not self.dry_run:  # someone else (an operator, a failed start) may have resized
            for pool in WORKER_ROLES:
                size = self.target.replicas(pool)
                self.states[pool] = dataclasses.replace(self.states[pool], replicas=size)
        current = {pool: state.replicas for pool, state in self.states.items()}
        # The pools' state is now, not predicted: it floors what the load asks for.
        by_pressure = pressure_replicas(self.profile, load, self.policy, corrections, current)
        wanted = wanted_replicas(by_load, by_pressure)
        PREDICTED_RATE.set(predicted.rate)
        CORRECTION.labels(Role.PREFILL.value).set(corrections.prefill)
        CORRECTION.labels(Role.DECODE.value).set(corrections.decode)
        decisions = []
        for pool in WORKER_ROLES:
            size, signal = wanted[pool]
            decision, state = decide(pool, self.states[pool], size, now_s, self.policy)
            decision = dataclasses.replace(decision, signal=signal)
            if decision.target != decision.current and not self.dry_run:
                self.target.scale(pool, decision.target)
            self.states[pool] = state  # a dry run goes on as if applied: what it would do
            DESIRED.labels(pool.value).set(decision.desired)
            ACTUAL.labels(pool.value).set(self.states[pool].replicas)
            DECISIONS.labels(pool.value, decision.reason.value).inc()
            SIGNALS.labels(pool.value, signal.value).inc()
            logger.info(
                "%s: %d -> %d (desired %d by %s, %s; predicted %.2f req/s, %.0f+%.0f tokens; "
                "decode KV %s, prefill queue %s, SLO met: TTFT %s, TPOT %s%s)",
                pool.value,
                decision.current,
                decision.target,
                decision.desired,
                signal.value,
                decision.reason.value,
                predicted.rate,
                predicted.mean_prompt_tokens,
                predicted.mean_output_tokens,
                "n/a" if load.decode_kv_usage is None else f"{load.decode_kv_usage:.0%}",
                "n/a" if load.prefill_queue_depth is None else f"{load.prefill_queue_depth:g}",
                "n/a" if load.ttft_attainment is None else f"{load.ttft_attainment:.0%}",
                "n/a" if load.tpot_attainment is None else f"{load.tpot_attainment:.0%}",
                ", dry run" if self.dry_run else "",
            )
            decisions.append(decision)
        return decisions

    def run(self, stop: threading.Event) -> None:
        """Ticks every ``interval_s`` until ``stop``; a failed round is logged, not fatal."""
        while True:
            try:
                self.tick()
            except Exception:
                FAILED_ROUNDS.inc()
                logger.exception("autoscale round failed")
            if stop.wait(self.policy.interval_s):
                return
