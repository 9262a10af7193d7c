"""The load the routers see, from their Prometheus ``/metrics``: each router's cumulative
totals (``totals``, pure), turned into one interval's ``Load`` by the per-router difference of
two readings, summed over every router replica (``load_between``, pure); ``scrape`` is the
thin I/O part. The rate is of arrivals (``pdserve_router_arrivals_total``), not of finished
requests: long streams are load long before they finish. The SLO attainment is of the requests
with a target (``pdserve_slo_requests_total``; a request flow control shed counts as a TTFT
miss). The pools' own state (the decode
pool's KV usage, the prefill pool's queue) comes from the workers' pages (``pool_pressure``,
pure) when no Prometheus is read (``prometheus_meter.py`` asks it the same). Every page is
parsed once, into its samples summed by name (``page_gauges``)."""

from __future__ import annotations

import dataclasses
import math
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from app.capacity.scaling import Load

_SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PoolPressure:
    decode_kv_usage: float | None  # used / all KV blocks of the decode pool; None: no series
    prefill_queue_depth: float | None  # requests waiting on the prefill pool; None: no series


@dataclass(frozen=True)
class Totals:
    """One router's cumulative counters at one time."""

    time_s: float
    num_arrivals: float = 0.0  # admitted (the load), whether finished or not
    num_finished: float = 0.0
    prompt_tokens: float = 0.0  # of finished requests
    output_tokens: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    tpot_sum_s: float = 0.0
    tpot_count: float = 0.0
    # Requests with a target that met or missed it (docs/slo.md), and those flow control
    # turned away (each a TTFT miss: it got no first token).
    ttft_met: float = 0.0
    ttft_missed: float = 0.0
    tpot_met: float = 0.0
    tpot_missed: float = 0.0
    shed: float = 0.0

    def __post_init__(self) -> None:
        # A NaN or an infinity (a broken exporter, a Prometheus answer) would poison every
        # later interval's load: the reading is refused, and the round with it, by name.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value):
                raise ValueError(f"a router reading has {f.name} = {value}: not a number")


SAMPLES = {
    "pdserve_router_arrivals_total": "num_arrivals",
    "pdserve_request_prompt_tokens_count": "num_finished",
    "pdserve_request_prompt_tokens_sum": "prompt_tokens",
    "pdserve_request_output_tokens_sum": "output_tokens",
    "pdserve_ttft_seconds_sum": "ttft_sum_s",
    "pdserve_ttft_seconds_count": "ttft_count",
    "pdserve_tpot_seconds_sum": "tpot_sum_s",
    "pdserve_tpot_seconds_count": "tpot_count",
    'pdserve_slo_requests_total{target="ttft",result="met"}': "ttft_met",
    'pdserve_slo_requests_total{target="ttft",result="missed"}': "ttft_missed",
    'pdserve_slo_requests_total{target="tpot",result="met"}': "tpot_met",
    'pdserve_slo_requests_total{target="tpot",result="missed"}': "tpot_missed",
    "pdserve_flow_shed_total": "shed",
}
_FIELDS = tuple(SAMPLES.values())


def selector(sample: str) -> tuple[str, dict[str, str]]:
    """A ``SAMPLES`` key as its sample name and the labels it requires (PromQL's syntax,
    ``name{label="value",...}``: every series of the name whose labels include them)."""
    name, _, rest = sample.partition("{")
    labels = {}
    for pair in filter(None, rest.rstrip("}").split(",")):
        key, _, value = pair.partition("=")
        labels[key] = value.strip('"')
    return name, labels


def totals(text: str, time_s: float) -> Totals:
    """One router's ``/metrics`` page."""
    wanted = {field: selector(sample) for sample, field in SAMPLES.items()}
    values = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for field, (name, labels) in wanted.items():
                if s.name == name and labels.items() <= s.labels.items():
                    values[field] += float(s.value)
    return Totals(time_s, **values)


def _delta(before: Totals | None, after: Totals) -> dict[str, float]:
    """One router's interval. Unseen before (a new replica), or a counter went down (it
    restarted): everything it counted is this interval's."""
    if before is None or any(getattr(after, f) < getattr(before, f) for f in _FIELDS):
        return {f: getattr(after, f) for f in _FIELDS}
    return {f: getattr(after, f) - getattr(before, f) for f in _FIELDS}


def load_between(
    before: Mapping[str, Totals],
    after: Mapping[str, Totals],
    span_s: float,
    previous: Load | None = None,
) -> Load:
    """The interval's load over every router (keyed by its URL): arrivals per second, and
    the lengths and latencies of the requests that finished; an interval in which none
    finished keeps the previous interval's lengths (the load's shape did not change because
    its requests are still running)."""
    if span_s <= 0:
        raise ValueError("the second reading must be later than the first")
    sums = dict.fromkeys(_FIELDS, 0.0)
    for key, now in after.items():
        for f, v in _delta(before.get(key), now).items():
            sums[f] += v
    time_s = max((t.time_s for t in after.values()), default=0.0)
    n = sums["num_finished"]
    if n:
        prompt, output = sums["prompt_tokens"] / n, sums["output_tokens"] / n
    elif previous is not None:
        prompt, output = previous.mean_prompt_tokens, previous.mean_output_tokens
    else:
        prompt = output = 0.0
    ttft_n, tpot_n = sums["ttft_count"], sums["tpot_count"]
    return Load(
        time_s,
        sums["num_arrivals"] / span_s,
        prompt,
        output,
        sums["ttft_sum_s"] / ttft_n if ttft_n else None,
        sums["tpot_sum_s"] / tpot_n if tpot_n else None,
        ttft_attainment=_share(sums["ttft_met"], sums["ttft_missed"] + sums["shed"]),
        tpot_attainment=_share(sums["tpot_met"], sums["tpot_missed"]),
    )


def _share(met: float, missed: float) -> float | None:
    """What share of the requests with a target met it; None: none had one."""
    return met / (met + missed) if met + missed > 0 else None


def scrape(url: str) -> str:
    """One ``/metrics`` page (blocking; the autoscaler's loop is a thread)."""
    with urllib.request.urlopen(url, timeout=_SCRAPE_TIMEOUT_S) as response:
        return str(response.read().decode())


Gauges = dict[str, float]  # one page: each sample name's summed value


def page_gauges(text: str) -> Gauges:
    """One ``/metrics`` page (a worker's or a router's), parsed once: every sample summed by
    name (its series add up). ValueError when it is not Prometheus text."""
    gauges: Gauges = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            gauges[s.name] = gauges.get(s.name, 0.0) + float(s.value)
    return gauges


def gauges_at(url: str) -> Gauges | None:
    """The gauges of the worker at ``url``; None when it does not answer with a page."""
    try:
        return page_gauges(scrape(url))
    except (OSError, ValueError):
        return None


def pool_pressure(prefill: list[Gauges], decode: list[Gauges]) -> PoolPressure:
    """The pools' state from their workers' pages (the ones that answered): the decode
    pool's used share of its KV blocks, the requests queued on the prefill pool. None where
    no worker answered (or the decode pool reported no blocks)."""
    used = sum(g.get("pdserve_kv_blocks_used", 0.0) for g in decode)
    free = sum(g.get("pdserve_kv_blocks_free", 0.0) for g in decode)
    queued = sum(g.get("pdserve_queue_depth", 0.0) for g in prefill)
    return PoolPressure(
        used / (used + free) if used + free > 0 else None,
        queued if prefill else None,
    )


def reachable_gauges(urls: list[str]) -> list[Gauges]:
    """The pages of the workers that answer with one (scraped at once: one gone, slow or
    answering garbage costs its page, not the round)."""
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return [gauges for gauges in pool.map(gauges_at, urls) if gauges is not None]
