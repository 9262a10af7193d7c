"""``pdserve autoscale --prometheus``: the autoscaler reads the routers' totals and the pools'
state from a Prometheus HTTP API server started here (it answers the instant queries the
meter sends, from scripted series, and refuses any other query as Prometheus would), and
scales the Kubernetes target of ``test_kubernetes_target`` (a minimal API server). Exact
decisions: the decode pool's KV pressure grows it; prompts queued on prefill beyond what the
TTFT SLO drains grow prefill; when both fall, hysteresis holds the pools one interval, then
they shrink."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

import pytest
from prometheus_client import REGISTRY

pytest.importorskip("kubernetes")

from app.capacity.autoscaler import Autoscaler
from app.capacity.load_meter import SAMPLES
from app.capacity.prometheus_meter import (
    PoolJobs,
    PrometheusError,
    PrometheusMeter,
    kv_usage_query,
    queue_query,
    router_query,
    scalar,
    vector,
)
from app.capacity.scale_target import KubernetesTarget
from app.capacity.scaling import (
    Reason,
    ScalingPolicy,
    Signal,
    prefill_tokens_per_s,
)
from pdserve.common.role import Role
from tests.capacity.test_kubernetes_target import ApiState, cluster  # noqa: F401
from tests.capacity.test_kubernetes_target import _serve as serve
from tests.capacity.test_scaling import PROFILE

JOBS = PoolJobs()


def test_the_queries_are_prometheus_instant_queries_by_job() -> None:
    assert router_query("pdserve_router_arrivals_total", JOBS) == (
        'sum by (instance) (pdserve_router_arrivals_total{job=~".*-router"})'
    )
    assert kv_usage_query(JOBS) == (
        'sum(pdserve_kv_blocks_used{job=~".*-decode"}) / (sum(pdserve_kv_blocks_used'
        '{job=~".*-decode"}) + sum(pdserve_kv_blocks_free{job=~".*-decode"}))'
    )
    assert queue_query(JOBS) == 'sum(pdserve_queue_depth{job=~".*-prefill"})'
    answer = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": {"instance": "a"}, "value": [1.0, "3"]}],
        },
    }
    assert vector(answer) == [({"instance": "a"}, 3.0)]
    assert scalar([]) is None and scalar([({}, math.nan)]) is None
    with pytest.raises(PrometheusError, match="bad_data"):
        vector({"status": "error", "errorType": "bad_data", "error": "bad_data: parse error"})


class Series:
    """The answers of the current round, by query; the queries the meter sent."""

    def __init__(self) -> None:
        self.answers: dict[str, list[tuple[dict[str, str], float]]] = {}
        self.asked: list[str] = []
        self.lock = threading.Lock()

    def set_round(self, arrivals: float, kv_usage: float, queue: float) -> None:
        """Two router replicas, half the requests each, all finished, 512 + 64 tokens."""
        per_router = arrivals / 2
        values = {
            "pdserve_router_arrivals_total": per_router,
            "pdserve_request_prompt_tokens_count": per_router,
            "pdserve_request_prompt_tokens_sum": per_router * 512,
            "pdserve_request_output_tokens_sum": per_router * 64,
        }
        answers = {
            router_query(s, JOBS): [
                ({"instance": f"router-{i}"}, values.get(s, 0.0)) for i in range(2)
            ]
            for s in SAMPLES
        }
        answers[kv_usage_query(JOBS)] = [({}, kv_usage)]
        answers[queue_query(JOBS)] = [({}, queue)]
        with self.lock:
            self.answers = answers


def _prometheus(series: Series) -> type[BaseHTTPRequestHandler]:
    class Api(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return None

        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query).get("query", [""])[0]
            with series.lock:
                series.asked.append(query)
                result = series.answers.get(query)
            if url.path != "/api/v1/query" or result is None:
                error = f"unknown query {query!r}"
                status = 400
                document = {"status": "error", "errorType": "bad_data", "error": error}
            else:
                rows = [{"metric": m, "value": [0.0, repr(v)]} for m, v in result]
                status = 200
                document = {"status": "success", "data": {"resultType": "vector", "result": rows}}
            body = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Api


@pytest.fixture
def prometheus() -> Iterator[tuple[Series, str]]:
    series = Series()
    server = serve(_prometheus(series), "127.0.0.1", 0)
    try:
        yield series, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _signals(pool: str, signal: str) -> float:
    labels = {"pool": pool, "signal": signal}
    return REGISTRY.get_sample_value("pdserve_planner_signals_total", labels) or 0.0


def test_kv_pressure_grows_decode_queued_prompts_grow_prefill_then_hysteresis(
    prometheus: tuple[Series, str],
    cluster: tuple[ApiState, KubernetesTarget],  # noqa: F811
) -> None:
    series, url = prometheus
    state, target = cluster  # prefill 1, decode 3
    policy = ScalingPolicy(
        slo_ttft_s=1.0,
        slo_tpot_s=0.05,
        interval_s=30.0,
        cooldown_s=0.0,
        down_after_intervals=2,
        correct_profile=False,
        kv_target=0.75,
    )
    meter = PrometheusMeter(url, JOBS)
    times = iter([0.0, 30.0, 60.0, 90.0, 120.0])
    scaler = Autoscaler(
        PROFILE, policy, meter.totals, target, clock=lambda: next(times), pressure=meter.pressure
    )
    # 1 request/s of 512 + 64 tokens: by load alone one worker of each pool.
    rounds = [
        (0.0, 0.3, 0.0),
        (30.0, 0.9, 0.0),
        (60.0, 0.6, 40.0),
        (90.0, 0.15, 0.0),
        (120.0, 0.15, 0.0),
    ]
    decisions = []
    kv_before = _signals("decode", "kv_pressure")
    for arrivals, kv_usage, queue in rounds:
        series.set_round(arrivals, kv_usage, queue)
        decisions.append({d.pool: d for d in scaler.tick()})
    assert decisions[0] == {}  # the first reading only starts the interval
    summary = [
        {pool: (d.current, d.target, d.reason, d.signal) for pool, d in round_.items()}
        for round_ in decisions[1:]
    ]
    # 20480 queued prompt tokens at one worker's 9534.6 tokens/s drain in 2.15 s: 3 workers.
    assert math.isclose(prefill_tokens_per_s(PROFILE, 512), 2048 / 0.2148)
    assert summary == [
        # KV at 90 % of 3 workers: ceil(3 x 0.9 / 0.75) = 4.
        {
            Role.PREFILL: (1, 1, Reason.STEADY, Signal.LOAD),
            Role.DECODE: (3, 4, Reason.UP, Signal.KV_PRESSURE),
        },
        # KV at 60 % of 4: ceil(3.2) = 4 holds; 40 prompts queued on prefill.
        {
            Role.PREFILL: (1, 3, Reason.UP, Signal.QUEUE),
            Role.DECODE: (4, 4, Reason.STEADY, Signal.KV_PRESSURE),
        },
        # Both fall: one interval below is not enough (down_after_intervals=2) ...
        {
            Role.PREFILL: (3, 3, Reason.HYSTERESIS, Signal.LOAD),
            Role.DECODE: (4, 4, Reason.HYSTERESIS, Signal.LOAD),
        },
        # ... two are.
        {
            Role.PREFILL: (3, 1, Reason.DOWN, Signal.LOAD),
            Role.DECODE: (4, 1, Reason.DOWN, Signal.LOAD),
        },
    ]
    assert state.replicas == {"rel-pdserve-prefill": 1, "rel-pdserve-decode": 1}
    assert _signals("decode", "kv_pressure") == kv_before + 2
    # Every query the meter sent was one Prometheus answered (none refused).
    assert set(series.asked) == {
        *(router_query(s, JOBS) for s in SAMPLES),
        kv_usage_query(JOBS),
        queue_query(JOBS),
    }


def test_a_prometheus_that_fails_a_query_fails_the_round_by_name(
    prometheus: tuple[Series, str],
) -> None:
    _, url = prometheus  # no answers set: every query is refused
    with pytest.raises(PrometheusError, match="HTTP Error 400"):
        PrometheusMeter(url).pressure()
    with pytest.raises(ValueError, match="--prometheus must be an http"):
        PrometheusMeter("prometheus:9090")


def test_a_reading_that_is_not_a_number_fails_the_round_by_name(
    prometheus: tuple[Series, str],
) -> None:
    """Prometheus answers NaN and infinities as values (a broken exporter, a division by 0):
    a pool's state that is not a number is unknown, and a router's totals that are not
    fail the round naming the field, instead of poisoning every later interval's load."""
    series, url = prometheus
    series.set_round(arrivals=10.0, kv_usage=math.inf, queue=math.nan)
    meter = PrometheusMeter(url)
    pools = meter.pressure()
    assert pools.decode_kv_usage is None and pools.prefill_queue_depth is None
    assert len(meter.totals(0.0)) == 2
    with series.lock:
        query = router_query("pdserve_router_arrivals_total", JOBS)
        series.answers[query] = [({"instance": "router-0"}, math.nan)]
    with pytest.raises(ValueError, match="num_arrivals = nan: not a number"):
        meter.totals(0.0)
