"""What serving adds to the engine-only profile: the router's hops before a first token and a
worker's per-step streaming cost. Measured from idle requests (one at a time) on a running
cluster, against what the simulator predicts for the same requests from the profile alone
(pure; the idle run itself is the caller's)."""

from __future__ import annotations

import dataclasses

from pdserve.app.bench.stats import Summary, summarize
from pdserve.app.bench.workload import BenchRequest
from pdserve.app.capacity.profile import Profile
from pdserve.app.capacity.simulator import ClusterShape, RouterModel, Simulator

IDLE_GAP_S = 1000.0  # simulated requests this far apart never overlap


def calibrate(
    profile: Profile, shape: ClusterShape, requests: list[BenchRequest], idle: Summary
) -> Profile:
    """``profile`` with ``router_overhead_s`` and ``step_overhead_s`` set from ``idle`` (the
    summary of ``requests`` sent one at a time to a cluster of ``shape``)."""
    base = dataclasses.replace(profile, router_overhead_s=0.0, step_overhead_s=0.0)
    arrivals_s = [IDLE_GAP_S * (i + 1) for i in range(len(requests))]
    router = RouterModel(prefill_policy="least_loaded")
    result = Simulator(base, shape, router).run(requests, arrivals_s)
    predicted = summarize(result.records, result.duration_s)
    return dataclasses.replace(
        base,
        router_overhead_s=max(0.0, idle.ttft_s.p50 - predicted.ttft_s.p50),
        step_overhead_s=max(0.0, idle.tpot_s.p50 - predicted.tpot_s.p50),
    )
