"""The routers' load as the autoscaler reads it: real router pages (the router's own metric
names, rendered by prometheus_client), differenced per router and summed over replicas."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.capacity.load_meter import (
    Gauges,
    PoolPressure,
    Totals,
    load_between,
    page_gauges,
    pool_pressure,
    reachable_gauges,
    totals,
)


def _router_page(
    arrivals: int, lengths: list[tuple[int, int]], ttft_s: float, tpot_s: float
) -> str:
    registry = CollectorRegistry()
    Counter("pdserve_router_arrivals", "", registry=registry).inc(arrivals)
    prompt = Histogram("pdserve_request_prompt_tokens", "", registry=registry, buckets=(64, 512))
    output = Histogram("pdserve_request_output_tokens", "", registry=registry, buckets=(64, 512))
    ttft = Histogram("pdserve_ttft_seconds", "", registry=registry)
    tpot = Histogram("pdserve_tpot_seconds", "", registry=registry)
    for p, o in lengths:
        prompt.observe(p)
        output.observe(o)
        ttft.observe(ttft_s)
        tpot.observe(tpot_s)
    return generate_latest(registry).decode()


def test_routers_are_differenced_one_by_one_and_summed() -> None:
    a0 = totals(_router_page(1, [(100, 10)], 0.5, 0.02), 0.0)
    a1 = totals(_router_page(5, [(100, 10), (300, 30)], 0.5, 0.02), 10.0)
    assert a1 == Totals(10.0, 5, 2, 400, 40, 1.0, 2, 0.04, 2)
    b0 = totals(_router_page(0, [], 0.2, 0.05), 0.0)
    b1 = totals(_router_page(3, [(200, 20)], 0.2, 0.05), 10.0)
    load = load_between({"a": a0, "b": b0}, {"a": a1, "b": b1}, 10.0)
    # Arrivals 4 + 3 over 10 s; finished: a's (300, 30) and b's (200, 20).
    assert load.rate == pytest.approx(0.7)
    assert (load.mean_prompt_tokens, load.mean_output_tokens) == (250, 25)
    assert load.mean_ttft_s == pytest.approx(0.35) and load.mean_tpot_s == pytest.approx(0.035)
    # Router b restarted (its counters went down), a new router c joined: each counts what
    # it holds; a's interval is still a difference (no spike from the others).
    b2 = totals(_router_page(2, [], 0.2, 0.05), 20.0)
    c2 = totals(_router_page(1, [], 0.2, 0.05), 20.0)
    a2 = totals(_router_page(5, [(100, 10), (300, 30)], 0.5, 0.02), 20.0)
    later = load_between({"a": a1, "b": b1}, {"a": a2, "b": b2, "c": c2}, 10.0, previous=load)
    assert later.rate == pytest.approx(0.3)  # 0 + 2 + 1
    # Nothing finished: the lengths are the previous interval's, no latency observed.
    assert (later.mean_prompt_tokens, later.mean_output_tokens) == (250, 25)
    assert later.mean_ttft_s is None and later.mean_tpot_s is None
    with pytest.raises(ValueError):
        load_between({"a": a1}, {"a": a1}, 0.0)
    page = 'pdserve_running_requests 3.0\npdserve_queue_depth{a="1"} 2.0\npdserve_queue_depth 1\n'
    gauges = page_gauges(page)
    assert gauges == {"pdserve_running_requests": 3.0, "pdserve_queue_depth": 3.0}
    with pytest.raises(ValueError):
        page_gauges("pdserve_kv_blocks_used{ not a sample\n")


def _worker_page(used: int, free: int, queued: int) -> Gauges:
    """A worker's page, parsed: the gauges under the names ``pdserve.common.metrics`` exports."""
    from pdserve.common import metrics

    registry = CollectorRegistry()
    for gauge, value in (
        (metrics.KV_BLOCKS_USED, used),
        (metrics.KV_BLOCKS_FREE, free),
        (metrics.QUEUE_DEPTH, queued),
    ):
        Gauge(gauge._name, "", registry=registry).set(value)
    return page_gauges(generate_latest(registry).decode())


def test_the_pools_pressure_sums_their_workers_pages() -> None:
    prefill = [_worker_page(10, 90, 3), _worker_page(0, 100, 4)]
    decode = [_worker_page(60, 40, 1), _worker_page(30, 70, 0), _worker_page(0, 0, 0)]
    # Decode: 90 of 200 blocks used; prefill: 7 queued (the decode pool's queue is not it).
    assert pool_pressure(prefill, decode) == PoolPressure(0.45, 7.0)
    # No page answered: nothing known (the scaler then goes by the load alone).
    assert pool_pressure([], []) == PoolPressure(None, None)
    assert pool_pressure([], [_worker_page(0, 0, 0)]) == PoolPressure(None, None)


def test_a_worker_that_does_not_answer_costs_its_page_only() -> None:
    """Of a real page, a refused connection and a page that is not Prometheus text, only
    the real page is read."""
    import http.server
    import socket
    import threading

    from pdserve.common.metrics_server import start_metrics_server

    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"pdserve_kv_blocks_used{ not a sample\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    live = start_metrics_server("127.0.0.1", 0)  # this process's real page (daemon thread)
    garbage = http.server.HTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=garbage.serve_forever, daemon=True).start()
    try:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
            ports = (closed.getsockname()[1], live, garbage.server_address[1])
            urls = [f"http://127.0.0.1:{port}/metrics" for port in ports]
            (page,) = reachable_gauges(urls)
    finally:
        garbage.shutdown()
        garbage.server_close()
    assert "pdserve_kv_blocks_used" in page  # the live page


def _slo_page(met: dict[tuple[str, str, str], int], shed: dict[tuple[str, str], int]) -> str:
    """A router page with only flow control's counters: (class, target, result) -> count,
    (class, reason) -> count."""
    registry = CollectorRegistry()
    slo = Counter("pdserve_slo_requests", "", ["class", "target", "result"], registry=registry)
    for labels, n in met.items():
        slo.labels(*labels).inc(n)
    sheds = Counter("pdserve_flow_shed", "", ["class", "reason"], registry=registry)
    for labels, n in shed.items():
        sheds.labels(*labels).inc(n)
    return generate_latest(registry).decode()


def test_slo_attainment_counts_every_class_and_sheds_as_ttft_misses() -> None:
    before = totals(_slo_page({}, {}), 0.0)
    page = _slo_page(
        {
            ("interactive", "ttft", "met"): 70,
            ("interactive", "ttft", "missed"): 10,
            ("chat", "ttft", "met"): 10,
            ("interactive", "tpot", "met"): 45,
            ("interactive", "tpot", "missed"): 5,
        },
        {("interactive", "slo_unreachable"): 6, ("batch", "queue_full"): 4},
    )
    after = totals(page, 10.0)
    assert (after.ttft_met, after.ttft_missed, after.tpot_met, after.shed) == (80, 10, 45, 10)
    load = load_between({"r": before}, {"r": after}, 10.0)
    assert load.ttft_attainment == pytest.approx(80 / (80 + 10 + 10))
    assert load.tpot_attainment == pytest.approx(45 / 50)
    assert load_between({"r": before}, {"r": before}, 10.0).ttft_attainment is None
