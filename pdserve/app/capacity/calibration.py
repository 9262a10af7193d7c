"""What serving changes in the engine-only profile: the router's hops before a first token and
a worker's per-step cost. Measured from idle requests (one at a time) on a running cluster,
against what the simulator predicts for the same requests from the profile alone (pure; the
idle run itself is the caller's). The step first: a TPOT above the prediction is a per-step
overhead (streaming), one below it means the engine runs faster in the cluster than where it
was profiled (another process state, thread placement), a scale on every step; then the TTFT
left over, with the step so fixed, is the router's overhead."""

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
    """``profile`` with ``step_overhead_s`` or ``step_scale``, then ``router_overhead_s``, set
    from ``idle`` (the summary of ``requests`` sent one at a time to a cluster of ``shape``)."""
    base = dataclasses.replace(profile, router_overhead_s=0.0, step_overhead_s=0.0, step_scale=1.0)
    predicted = _idle_prediction(base, shape, requests)
    real_tpot, sim_tpot = idle.tpot_s.p50, predicted.tpot_s.p50
    if real_tpot == real_tpot and sim_tpot > 0:  # NaN: single-token outputs, no TPOT
        if real_tpot >= sim_tpot:
            base = dataclasses.replace(base, step_overhead_s=real_tpot - sim_tpot)
        else:
            base = dataclasses.replace(base, step_scale=real_tpot / sim_tpot)
        predicted = _idle_prediction(base, shape, requests)
    return dataclasses.replace(
        base, router_overhead_s=max(0.0, idle.ttft_s.p50 - predicted.ttft_s.p50)
    )


def _idle_prediction(
    profile: Profile, shape: ClusterShape, requests: list[BenchRequest]
) -> Summary:
    arrivals_s = [IDLE_GAP_S * (i + 1) for i in range(len(requests))]
    router = RouterModel(prefill_policy="least_loaded")
    result = Simulator(profile, shape, router).run(requests, arrivals_s)
    return summarize(result.records, result.duration_s)
