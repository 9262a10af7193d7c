"""Which prefill:decode split (or colocated count) serves a load within SLOs: every shape up to
``max_workers`` is simulated on the same seeded workload, and the cheapest that keeps
``attainment`` of requests within both SLOs wins (pure: the simulator is pure).

The choice (``recommend``): among candidates whose SLO attainment >= ``attainment``, fewest
workers, then the highest goodput per worker, then the lower p90 TTFT; when none attains it,
the best attainment is reported as the closest, not as a recommendation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.bench.stats import Summary, summarize
from app.bench.workload import BenchRequest
from app.capacity.profile import Profile
from app.capacity.simulator import ClusterShape, RouterModel, Simulator

DEFAULT_ATTAINMENT = 0.9


@dataclass(frozen=True)
class Candidate:
    shape: ClusterShape
    goodput: float  # requests / s within both SLOs
    slo_fraction: float  # of all requests
    ttft_p90_s: float
    tpot_p90_s: float

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.shape.num_workers

    def to_json(self) -> dict[str, Any]:
        s = self.shape
        return {
            "prefill": s.num_prefill,
            "decode": s.num_decode,
            "colocated": s.num_colocated,
            "label": s.label,
            "goodput": self.goodput,
            "goodput_per_worker": self.goodput_per_worker,
            "slo_fraction": self.slo_fraction,
            "ttft_p90_s": self.ttft_p90_s,
            "tpot_p90_s": self.tpot_p90_s,
        }


def candidate_shapes(max_workers: int, colocated: bool = True) -> list[ClusterShape]:
    """Every P:D with P, D >= 1 and P + D <= max_workers, then colocated 1..max_workers."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    shapes = [
        ClusterShape(p, total - p) for total in range(2, max_workers + 1) for p in range(1, total)
    ]
    if colocated:
        shapes += [ClusterShape(num_colocated=k) for k in range(1, max_workers + 1)]
    return shapes


def candidate_of(shape: ClusterShape, summary: Summary) -> Candidate:
    return Candidate(
        shape, summary.goodput, summary.slo_fraction, summary.ttft_s.p90, summary.tpot_s.p90
    )


def recommend(
    candidates: list[Candidate], attainment: float = DEFAULT_ATTAINMENT
) -> tuple[Candidate | None, Candidate | None]:
    """(the recommendation or None, the closest candidate when there is none)."""
    if not candidates:
        return None, None
    able = [c for c in candidates if c.slo_fraction >= attainment]
    if able:
        best = min(able, key=lambda c: (c.shape.num_workers, -c.goodput_per_worker, c.ttft_p90_s))
        return best, None
    closest = max(candidates, key=lambda c: (c.slo_fraction, -c.shape.num_workers))
    return None, closest


def simulate_shape(
    profile: Profile,
    shape: ClusterShape,
    requests: list[BenchRequest],
    arrivals_s: list[float],
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
    router: RouterModel | None = None,
    shared_cores: int | None = None,
) -> Summary:
    simulator = Simulator(profile, shape, router or RouterModel(), shared_cores)
    result = simulator.run(requests, arrivals_s)
    return summarize(result.records, result.duration_s, slo_ttft_s, slo_tpot_s)


def search(
    profile: Profile,
    requests: list[BenchRequest],
    arrivals_s: list[float],
    slo_ttft_s: float,
    slo_tpot_s: float,
    max_workers: int,
    router: RouterModel | None = None,
    shared_cores: int | None = None,
) -> list[Candidate]:
    """``shared_cores``: the candidates share one host's cores (``Simulator``)."""
    slos = (slo_ttft_s, slo_tpot_s)
    return [
        candidate_of(
            shape,
            simulate_shape(profile, shape, requests, arrivals_s, *slos, router, shared_cores),
        )
        for shape in candidate_shapes(max_workers)
    ]


def helm_values(candidate: Candidate, profile: Profile) -> dict[str, Any]:
    """The chart's values for a candidate. Colocated: decode workers that prefill everything
    themselves (the router's local-prefill bound above any prompt), no prefill pool."""
    engine = {
        "maxNumSeqs": profile.max_num_seqs,
        "maxNumBatchedTokens": profile.max_num_batched_tokens,
        "numBlocks": profile.num_blocks,
    }
    s = candidate.shape
    if s.num_colocated:
        return {
            "prefill": {"replicas": 0},
            "decode": {"replicas": s.num_colocated, "engine": engine},
            "router": {"extraArgs": ["--local-prefill-tokens", "1000000000"]},
        }
    return {
        "prefill": {"replicas": s.num_prefill, "engine": engine},
        "decode": {"replicas": s.num_decode, "engine": engine},
    }
