"""Benchmark statistics on synthetic timestamps with known answers."""

from __future__ import annotations

import math

import pytest

from app.bench.stats import RequestRecord, percentile, summarize
from app.bench.workload import BenchRequest, shared_prefix, synthetic


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 50) == 30.0
    assert percentile(values, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert percentile(values, 99) == pytest.approx(49.6)
    assert percentile(list(reversed(values)), 25) == 20.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be"):
        percentile(values, 101)


def _record(index: int, send: float, chunks: list[float], tokens: int) -> RequestRecord:
    return RequestRecord(index, 16, send, chunks, tokens)


def test_request_latencies() -> None:
    r = _record(0, 1.0, [1.2, 1.3, 1.5, 1.6], 5)  # last chunk carries 2 tokens
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.6)
    assert r.tpot_s == pytest.approx(0.4 / 4)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.1])
    assert _record(1, 0.0, [0.5], 1).tpot_s is None


def test_summary_goodput_and_slo_fraction() -> None:
    records = [
        _record(0, 0.0, [0.1, 0.2, 0.3], 3),  # TTFT 100 ms, TPOT 100 ms: good
        _record(1, 0.0, [0.5, 0.55, 0.6], 3),  # TTFT 500 ms: misses the TTFT SLO
        _record(2, 1.0, [1.1, 1.4, 1.7], 3),  # TPOT 300 ms: misses the TPOT SLO
        _record(3, 1.0, [1.05, 1.1, 1.15], 3),  # good
        RequestRecord(4, 16, 2.0, [], 0, "UNAVAILABLE: gone"),  # failed
    ]
    s = summarize(records, duration_s=2.0, slo_ttft_s=0.2, slo_tpot_s=0.2)
    assert (s.num_requests, s.num_completed, s.num_failed) == (5, 4, 1)
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.slo_fraction == pytest.approx(2 / 5)
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert s.output_token_throughput == pytest.approx(12 / 2.0)
    assert s.input_token_throughput == pytest.approx(64 / 2.0)
    assert s.ttft_s.p50 == pytest.approx(0.1)  # TTFTs 0.05, 0.1, 0.1, 0.5
    assert s.ttft_s.mean == pytest.approx(0.75 / 4)
    assert s.tpot_s.p90 == pytest.approx(0.1 + 0.7 * 0.2)  # TPOTs 0.05, 0.05, 0.1, 0.3
    assert s.e2e_s.p99 == pytest.approx(0.6 + 0.97 * 0.1)  # E2Es 0.15, 0.3, 0.6, 0.7
    without_slo = summarize(records, duration_s=2.0)
    assert without_slo.goodput == pytest.approx(without_slo.request_throughput)
    with pytest.raises(ValueError, match="duration_s"):
        summarize(records, duration_s=0.0)


def test_workloads_are_seeded_and_shaped() -> None:
    a, b = synthetic(3, 20, 7, seed=1), synthetic(3, 20, 7, seed=1)
    assert a == b and a != synthetic(3, 20, 7, seed=2)
    assert all(len(r.prompt_token_ids) == 20 and r.output_len == 7 for r in a)
    shared = shared_prefix(8, 40, 4, seed=0, num_prefixes=2)
    assert shared[0].prompt_token_ids[:30] == shared[2].prompt_token_ids[:30]
    assert shared[0].prompt_token_ids[:30] != shared[1].prompt_token_ids[:30]
    assert shared[0].prompt_token_ids[30:] != shared[2].prompt_token_ids[30:]
    with pytest.raises(ValueError, match="exactly one"):
        BenchRequest()
