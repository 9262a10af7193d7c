"""The autoscaler's inputs from a Prometheus server (``pdserve autoscale --prometheus URL``),
through its standard HTTP API (``GET /api/v1/query``), instead of scraping pdserve's own
endpoints: what a cluster whose Prometheus already scrapes every replica uses.

Which series belong to which pool is told by their ``job`` label (``PoolJobs``: regular
expressions; the chart's ServiceMonitor makes one job per Service, ``<release>-router`` and so
on). It reads each router's cumulative totals (one ``Totals`` per ``instance``, so a restarted
replica is seen as one: ``load_meter.load_between``) and the pools' state: the decode pool's
KV usage and the prefill pool's queue depth (``scaling.pressure_replicas``). The queries are
built and their answers parsed by pure functions; ``query`` is the only I/O.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from app.capacity.load_meter import SAMPLES, PoolPressure, Totals, selector

_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PoolJobs:
    """The ``job`` label of each component's series (regular expressions, fully anchored)."""

    router: str = ".*-router"
    prefill: str = ".*-prefill"
    decode: str = ".*-decode"


class PrometheusError(RuntimeError):
    """Prometheus did not answer a query (the round is retried next interval)."""


def router_query(sample: str, jobs: PoolJobs) -> str:
    """A ``SAMPLES`` key's sum per router replica (its label matchers kept)."""
    name, labels = selector(sample)
    matchers = ",".join([f'job=~"{jobs.router}"', *(f'{k}="{v}"' for k, v in labels.items())])
    return f"sum by (instance) ({name}{{{matchers}}})"


def kv_usage_query(jobs: PoolJobs) -> str:
    used = f'sum(pdserve_kv_blocks_used{{job=~"{jobs.decode}"}})'
    free = f'sum(pdserve_kv_blocks_free{{job=~"{jobs.decode}"}})'
    return f"{used} / ({used} + {free})"


def queue_query(jobs: PoolJobs) -> str:
    return f'sum(pdserve_queue_depth{{job=~"{jobs.prefill}"}})'


def vector(document: dict[str, Any]) -> list[tuple[dict[str, str], float]]:
    """An instant query's answer: (labels, value) per series. Raises ``PrometheusError``."""
    if document.get("status") != "success":
        raise PrometheusError(f"query failed: {document.get('error', document)}")
    data = document.get("data", {})
    if data.get("resultType") != "vector":
        raise PrometheusError(f"expected a vector, got {data.get('resultType')}")
    return [(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]


def totals_by_instance(
    answers: dict[str, list[tuple[dict[str, str], float]]], time_s: float
) -> dict[str, Totals]:
    """``answers``: per router sample name (``load_meter.SAMPLES``), its vector by instance."""
    fields: dict[str, dict[str, float]] = {}
    for sample, series in answers.items():
        for labels, value in series:
            instance = labels.get("instance", "")
            fields.setdefault(instance, {})[SAMPLES[sample]] = value
    return {instance: Totals(time_s, **values) for instance, values in fields.items()}


def scalar(series: list[tuple[dict[str, str], float]]) -> float | None:
    """A one-series answer's value; None when no series matched, or it is not a number (NaN:
    0 / 0, an empty pool; or an infinity)."""
    if not series or not math.isfinite(series[0][1]):
        return None
    return series[0][1]


class PrometheusMeter:
    def __init__(self, url: str, jobs: PoolJobs = PoolJobs()) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--prometheus must be an http:// or https:// URL, got {url!r}")
        self.url = url.rstrip("/")
        self.jobs = jobs

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        params = urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(
                f"{self.url}/api/v1/query?{params}", timeout=_TIMEOUT_S
            ) as r:
                return vector(json.loads(r.read().decode()))
        except (OSError, ValueError) as exc:  # unreachable, HTTP error, not JSON
            raise PrometheusError(f"{self.url}: {exc}") from None

    def totals(self, time_s: float) -> dict[str, Totals]:
        """Each router replica's cumulative totals, keyed by its instance."""
        answers = {s: self.query(router_query(s, self.jobs)) for s in SAMPLES}
        return totals_by_instance(answers, time_s)

    def pressure(self) -> PoolPressure:
        return PoolPressure(
            scalar(self.query(kv_usage_query(self.jobs))),
            scalar(self.query(queue_query(self.jobs))),
        )
