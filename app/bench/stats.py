"""Latency statistics from client-side timestamps (pure: no I/O, no numpy).

Definitions follow ``vllm bench serve``: TTFT = first token - send; TPOT = (last - first) /
(output tokens - 1); ITL = the gaps between consecutive streamed chunks; E2E = last - send.
A request is *good* when it finished with TTFT <= slo_ttft_s and TPOT <= slo_tpot_s; goodput is
good requests per second of the run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from router.phases import RequestPhase


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds on one monotonic clock."""

    index: int
    num_prompt_tokens: int
    send_s: float
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    num_output_tokens: int = 0
    error: str = ""  # the gRPC status, when it failed
    # Where the router says the time went (router/phases.py): seconds by phase.
    phases_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times_s)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.send_s

    @property
    def e2e_s(self) -> float:
        return self.chunk_times_s[-1] - self.send_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        mean = sum(values) / len(values) if values else math.nan
        return cls(mean, percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    request_throughput: float  # completed requests / s
    input_token_throughput: float  # prompt tokens of completed requests / s
    output_token_throughput: float  # output tokens / s
    goodput: float  # requests / s within both SLOs
    slo_fraction: float  # of all requests, the share within both SLOs
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    # Seconds by phase over completed requests (a phase a request had no part in counts 0).
    phases_s: dict[str, Distribution] = field(default_factory=dict)


def meets_slo(record: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    if not record.ok:
        return False
    if slo_ttft_s is not None and record.ttft_s > slo_ttft_s:
        return False
    tpot = record.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> Summary:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    good = [r for r in records if meets_slo(r, slo_ttft_s, slo_tpot_s)]
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    return Summary(
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done),
        duration_s=duration_s,
        ttft_s=Distribution.of([r.ttft_s for r in done]),
        tpot_s=Distribution.of(tpots),
        itl_s=Distribution.of([gap for r in done for gap in r.itls_s]),
        e2e_s=Distribution.of([r.e2e_s for r in done]),
        request_throughput=len(done) / duration_s,
        input_token_throughput=sum(r.num_prompt_tokens for r in done) / duration_s,
        output_token_throughput=sum(r.num_output_tokens for r in done) / duration_s,
        goodput=len(good) / duration_s,
        slo_fraction=len(good) / len(records) if records else math.nan,
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        phases_s=phase_distributions(done),
    )


def phase_distributions(records: list[RequestRecord]) -> dict[str, Distribution]:
    """Per phase, in the request's order (``router/phases.py``; unknown names last): its
    seconds over ``records``."""
    order = {p.value: i for i, p in enumerate(RequestPhase)}
    names = sorted(
        {name for r in records for name in r.phases_s}, key=lambda n: (order.get(n, len(order)), n)
    )
    return {n: Distribution.of([r.phases_s.get(n, 0.0) for r in records]) for n in names}
