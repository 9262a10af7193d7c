"""What serving changes in the engine-only profile: how long a prefill worker really takes to
prefill (the requests' ``prefill_compute`` phase, docs/observability.md), the router's hops
before a first token and a worker's per-step streaming cost. Measured from idle requests (one
at a time) on a running cluster, against what the simulator predicts for the same requests
from the profile (pure; the idle run itself is the caller's). The prefill first: a worker
process may prefill slower than the engine measured alone (other processes on its cores), and
every queue the simulator forms behind a prefill grows with it."""

from __future__ import annotations

import dataclasses

from app.bench.stats import Summary, summarize
from app.bench.workload import BenchRequest
from app.capacity.profile import Profile
from app.capacity.simulator import ClusterShape, RouterModel, Simulator

IDLE_GAP_S = 1000.0  # simulated requests this far apart never overlap
MAX_SCALE = 4.0


def calibrate(
    profile: Profile, shape: ClusterShape, requests: list[BenchRequest], idle: Summary
) -> Profile:
    """``profile`` with ``router_overhead_s`` and ``step_overhead_s`` set from ``idle`` (the
    summary of ``requests`` sent one at a time to a cluster of ``shape``)."""
    base = dataclasses.replace(
        profile,
        router_overhead_s=0.0,
        step_overhead_s=0.0,
        prefill_scale=prefill_scale(profile, requests, idle),
    )
    arrivals_s = [IDLE_GAP_S * (i + 1) for i in range(len(requests))]
    router = RouterModel(prefill_policy="least_loaded")
    result = Simulator(base, shape, router).run(requests, arrivals_s)
    predicted = summarize(result.records, result.duration_s)
    return dataclasses.replace(
        base,
        router_overhead_s=max(0.0, idle.ttft_s.p50 - predicted.ttft_s.p50),
        step_overhead_s=max(0.0, idle.tpot_s.p50 - predicted.tpot_s.p50),
    )


def prefill_scale(profile: Profile, requests: list[BenchRequest], idle: Summary) -> float:
    """Measured prefill compute (p50 of the idle requests' phase) over the profile's for the
    median prompt, on the prefill terms (bounded to [1/4, 4]); 1 without the phase (a
    colocated cluster reports none)."""
    measured = idle.phases_s.get("prefill_compute")
    if measured is None or not requests:
        return 1.0
    n = sorted(r.num_prompt_tokens for r in requests)[len(requests) // 2]
    terms = profile.prefill.terms((n, n * n / 1e3))
    if terms <= 0:
        return 1.0
    return min(MAX_SCALE, max(1 / MAX_SCALE, (measured.p50 - profile.prefill.intercept) / terms))
