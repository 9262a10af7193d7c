"""The planner's search and choice, with exact values; the profile's fits on known lines."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.workload import BenchRequest
from app.capacity import profile as profile_io
from app.capacity.planner import (
    Candidate,
    candidate_shapes,
    helm_values,
    recommend,
    search,
)
from app.capacity.profile import PREFILL_FEATURES, LinearFit, StepShape, fit_linear
from app.capacity.simulator import ClusterShape, poisson_arrivals
from tests.capacity.test_simulator import constant_profile


def _c(p: int, d: int, k: int, goodput: float, fraction: float, ttft: float = 0.1) -> Candidate:
    return Candidate(ClusterShape(p, d, k), goodput, fraction, ttft, 0.01)


def test_candidate_shapes_are_every_split_then_colocated() -> None:
    labels = [s.label for s in candidate_shapes(3)]
    assert labels == ["1P:1D", "1P:2D", "2P:1D", "colocated x1", "colocated x2", "colocated x3"]
    assert len(candidate_shapes(8)) == 28 + 8
    with pytest.raises(ValueError, match="max_workers"):
        candidate_shapes(0)


def test_recommend_takes_the_fewest_workers_that_attain_then_goodput_per_worker() -> None:
    candidates = [
        _c(1, 1, 0, goodput=1.6, fraction=0.80),  # 2 workers, misses 90 %
        _c(0, 0, 2, goodput=1.8, fraction=0.90),  # 2 workers, attains: 0.9 per worker
        _c(1, 2, 0, goodput=2.0, fraction=1.00),  # 3 workers
        _c(0, 0, 3, goodput=2.0, fraction=1.00),
    ]
    best, closest = recommend(candidates)
    assert best is candidates[1] and closest is None
    assert best.goodput_per_worker == pytest.approx(0.9)
    # Same worker count: the higher goodput per worker, then the lower p90 TTFT.
    tied = [_c(1, 2, 0, 2.0, 1.0, ttft=0.3), _c(2, 1, 0, 2.0, 1.0, ttft=0.2)]
    assert recommend(tied)[0] is tied[1]
    # None attains: no recommendation, the closest named.
    short = [_c(1, 1, 0, 1.0, 0.5), _c(0, 0, 2, 1.2, 0.6)]
    assert recommend(short) == (None, short[1])
    assert recommend([]) == (None, None)


def test_a_prefill_bound_load_gets_more_prefill_workers() -> None:
    # Prefill costs 1/3000 s per prompt token, decode 5 ms per step: 6/s of 600-token prompts
    # is 3600 prompt tokens/s, more than one prefill worker's 3000.
    flat = constant_profile(prefill_s=0.001, decode_s=0.005, max_num_seqs=64)
    per_token = LinearFit(PREFILL_FEATURES, 0.001, (1 / 3000, 0.0))
    profile = dataclasses.replace(flat, prefill=per_token)
    rng = random.Random(0)
    requests = [
        BenchRequest(tuple(rng.randrange(16, 1000) for _ in range(600)), output_len=8)
        for _ in range(300)
    ]
    arrivals = poisson_arrivals(len(requests), 6.0, seed=1)
    candidates = search(profile, requests, arrivals, 1.0, 0.05, max_workers=4)
    by_label = {c.shape.label: c for c in candidates}
    assert by_label["1P:2D"].slo_fraction < 0.5 < 0.9 <= by_label["2P:1D"].slo_fraction
    best, _ = recommend(candidates)
    assert best is not None and best.shape.label == "2P:1D"
    values = helm_values(by_label["2P:1D"], profile)
    assert values["prefill"]["replicas"] == 2 and values["decode"]["replicas"] == 1
    assert values["decode"]["engine"]["maxNumSeqs"] == 64
    colocated = helm_values(by_label["colocated x3"], profile)
    assert colocated["prefill"] == {"replicas": 0} and colocated["decode"]["replicas"] == 3


def test_fits_recover_known_lines_and_profiles_round_trip(tmp_path: Path) -> None:
    rows = [(t, t * t / 1e3) for t in (16, 64, 256, 1024)]
    times = [0.002 + 1e-5 * t + 4e-6 * c for t, c in rows]
    fit = fit_linear(PREFILL_FEATURES, rows, times)
    assert fit.intercept == pytest.approx(0.002) and fit.coefficients == pytest.approx((1e-5, 4e-6))
    assert fit.rmse_s == pytest.approx(0.0, abs=1e-12) and fit.num_samples == 4
    # A term measured as negative (noise) is dropped and the rest refitted.
    noisy = fit_linear(PREFILL_FEATURES, rows, [0.002 + 1e-5 * t - 1e-9 * c for t, c in rows])
    assert noisy.coefficients[1] == 0.0 and noisy.coefficients[0] > 0
    profile = constant_profile(prefill_s=0.1, decode_s=0.01, transfer_s=0.003)
    # A mixed step: one intercept (the larger), both parts.
    assert profile.step_s(StepShape(100, 1.0, 4, 0.5)) == pytest.approx(0.1)
    path = tmp_path / "profile.json"
    profile_io.save(profile, path)
    assert profile_io.load(path) == profile
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="profile version 99"):
        profile_io.load(path)


def test_the_planner_core_imports_no_io_and_no_torch() -> None:
    code = (
        "import sys\n"
        "import app.capacity.planner, app.capacity.simulator\n"
        "heavy = {'torch', 'numpy', 'grpc', 'redis', 'ray'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_calibration_sets_the_serving_overheads_from_idle_requests() -> None:
    from app.bench.stats import RequestRecord, summarize
    from app.capacity.calibration import calibrate

    profile = constant_profile(prefill_s=0.1, decode_s=0.01)
    rng = random.Random(5)
    requests = [BenchRequest(tuple(rng.randrange(16, 1000) for _ in range(64)), output_len=5)] * 3
    # Observed, one at a time: TTFT 0.15 s (the engine alone: 0.1), TPOT 0.013 s (0.01).
    records = [
        RequestRecord(i, 64, 10.0 * i, [10.0 * i + 0.15 + 0.013 * k for k in range(5)], 5)
        for i in range(3)
    ]
    idle = summarize(records, 30.0)
    calibrated = calibrate(profile, ClusterShape(num_colocated=1), requests, idle)
    assert calibrated.router_overhead_s == pytest.approx(0.05)
    assert calibrated.step_overhead_s == pytest.approx(0.003)
    assert calibrated.prefill == profile.prefill  # the engine's own fits are kept


def test_calibration_scales_the_prefill_to_what_the_prefill_workers_measured() -> None:
    from app.bench.stats import RequestRecord, summarize
    from app.capacity.calibration import calibrate, prefill_scale

    profile = dataclasses.replace(
        constant_profile(prefill_s=0.01, decode_s=0.01),
        prefill=LinearFit(PREFILL_FEATURES, 0.01, (1e-3, 0.0)),
    )
    requests = [BenchRequest(tuple(range(16, 80)), output_len=3)] * 3  # 64 tokens: 0.074 s
    # The prefill workers took 0.138 s in their prefill_compute phase: (0.138 - 0.01) / 0.064.
    records = [
        RequestRecord(
            i,
            64,
            10.0 * i,
            [10.0 * i + 0.16, 10.0 * i + 0.17, 10.0 * i + 0.18],
            3,
            phases_s={"prefill_compute": 0.138},
        )
        for i in range(3)
    ]
    idle = summarize(records, 30.0)
    assert prefill_scale(profile, requests, idle) == pytest.approx(2.0)
    calibrated = calibrate(profile, ClusterShape(1, 1), requests, idle)
    assert calibrated.prefill_scale == pytest.approx(2.0)
    # A colocated cluster reports no prefill_compute phase: the profile's prefill stands.
    for record in records:
        record.phases_s = {"local_prefill": 0.2}
    assert prefill_scale(profile, requests, summarize(records, 30.0)) == 1.0
