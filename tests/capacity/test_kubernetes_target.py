"""The Kubernetes scale target against a minimal API server started here: it implements only
the endpoints the target uses (Deployment scale get/patch, pod list/patch), checks every
request body against the kubernetes client's own models, and records the calls. The pods'
loads come from real /metrics endpoints, one per pod IP (127.0.0.x)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from prometheus_client import REGISTRY

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client  # noqa: E402

from app.capacity.autoscaler import Autoscaler  # noqa: E402
from app.capacity.load_meter import Totals  # noqa: E402
from app.capacity.scale_target import (  # noqa: E402
    DELETION_COST,
    VICTIM_COST,
    KubernetesTarget,
    PoolRef,
)
from app.capacity.scaling import Reason, ScalingPolicy  # noqa: E402
from pdserve.common.role import Role  # noqa: E402
from tests.capacity.test_scaling import PROFILE  # noqa: E402

NS = "llm"
MODELS = client.ApiClient()


def _model(data: bytes, kind: str) -> Any:
    """The body as the client's model: a wrong type or shape raises here."""
    return MODELS.deserialize(data.decode(), kind, "application/json")


@dataclass
class ApiState:
    replicas: dict[str, int]
    pods: dict[str, dict[str, Any]]  # name -> {"pool": ..., "ip": ...}
    calls: list[tuple[str, str]] = field(default_factory=list)
    annotations: dict[str, dict[str, str]] = field(default_factory=dict)


def _handler(state: ApiState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return None

        def _reply(self, document: dict[str, Any], status: int = 200) -> None:
            body = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _scale(self, name: str) -> dict[str, Any]:
            n = state.replicas[name]
            return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"replicas": n}, "status": {"replicas": n}}  # fmt: skip

        def _pod(self, name: str) -> dict[str, Any]:
            pod = state.pods[name]
            return {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "namespace": NS,
                                 "labels": {"role": pod["pool"]},
                                 "annotations": state.annotations.get(name, {})},
                    "status": {"phase": "Running", "podIP": pod["ip"]}}  # fmt: skip

        def do_GET(self) -> None:
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            state.calls.append(("GET", url.path))
            if url.path.endswith("/scale"):
                self._reply(self._scale(parts[-2]))
            elif url.path == f"/api/v1/namespaces/{NS}/pods":
                selector = parse_qs(url.query)["labelSelector"][0]
                role = selector.split("=")[1]
                items = [self._pod(n) for n, p in state.pods.items() if p["pool"] == role]
                self._reply({"apiVersion": "v1", "kind": "PodList", "metadata": {},
                             "items": items})  # fmt: skip
            else:
                self._reply({"kind": "Status", "code": 404}, 404)

        def do_PATCH(self) -> None:
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            data = self.rfile.read(int(self.headers["Content-Length"]))
            state.calls.append(("PATCH", url.path))
            assert "patch" in self.headers["Content-Type"]
            if url.path.endswith("/scale"):
                scale = _model(data, "V1Scale")
                state.replicas[parts[-2]] = scale.spec.replicas
                self._reply(self._scale(parts[-2]))
            else:
                pod = _model(data, "V1Pod")
                state.annotations.setdefault(parts[-1], {}).update(pod.metadata.annotations)
                self._reply(self._pod(parts[-1]))

    return Handler


def _serve(handler: type[BaseHTTPRequestHandler], host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _metrics_handler(text: str) -> type[BaseHTTPRequestHandler]:
    class Metrics(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return None

        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Metrics


@pytest.fixture
def cluster() -> Iterator[tuple[ApiState, KubernetesTarget]]:
    # Three decode pods with 5, 1 and 3 requests; each pod's /metrics on its own IP.
    loads = {"decode-a": 5, "decode-b": 1, "decode-c": 3}
    ips = {name: f"127.0.0.{i + 2}" for i, name in enumerate(loads)}
    first = _serve(_metrics_handler("pdserve_running_requests 5.0\n"), ips["decode-a"], 0)
    port = first.server_address[1]
    servers = [first] + [
        _serve(_metrics_handler(f"pdserve_running_requests {n}.0\npdserve_queue_depth 0.0\n"),
               ips[name], port)
        for name, n in loads.items() if name != "decode-a"
    ]  # fmt: skip
    state = ApiState(
        replicas={"rel-pdserve-prefill": 1, "rel-pdserve-decode": 3},
        pods={name: {"pool": "decode", "ip": ips[name]} for name in loads},
    )
    api = _serve(_handler(state), "127.0.0.1", 0)
    servers.append(api)
    configuration = client.Configuration(host=f"http://127.0.0.1:{api.server_address[1]}")
    api_client = client.ApiClient(configuration)
    pools = {
        Role.PREFILL: PoolRef("rel-pdserve-prefill", "role=prefill", port),
        Role.DECODE: PoolRef("rel-pdserve-decode", "role=decode", port),
    }
    target = KubernetesTarget(client.AppsV1Api(api_client), client.CoreV1Api(api_client), NS, pools)
    try:
        yield state, target
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


SCALE = f"/apis/apps/v1/namespaces/{NS}/deployments/rel-pdserve-decode/scale"


def test_scale_down_marks_the_least_loaded_pods_then_patches_the_scale(
    cluster: tuple[ApiState, KubernetesTarget],
) -> None:
    state, target = cluster
    assert target.replicas(Role.DECODE) == 3
    state.calls.clear()
    target.scale(Role.DECODE, 1)
    assert state.calls == [
        ("GET", SCALE),
        ("GET", f"/api/v1/namespaces/{NS}/pods"),
        ("PATCH", f"/api/v1/namespaces/{NS}/pods/decode-b"),  # 1 request
        ("PATCH", f"/api/v1/namespaces/{NS}/pods/decode-c"),  # 3 requests
        ("PATCH", SCALE),
    ]
    assert state.annotations == {
        "decode-b": {DELETION_COST: VICTIM_COST},
        "decode-c": {DELETION_COST: VICTIM_COST},
    }
    assert state.replicas["rel-pdserve-decode"] == 1
    # Down again later (3 -> 2): only b goes now; c's mark from before is cleared first.
    state.replicas["rel-pdserve-decode"] = 3
    state.calls.clear()
    target.scale(Role.DECODE, 2)
    assert state.calls == [
        ("GET", SCALE),
        ("GET", f"/api/v1/namespaces/{NS}/pods"),
        ("PATCH", f"/api/v1/namespaces/{NS}/pods/decode-c"),  # back to the default cost
        ("PATCH", f"/api/v1/namespaces/{NS}/pods/decode-b"),  # marked
        ("PATCH", SCALE),
    ]
    assert state.annotations == {
        "decode-b": {DELETION_COST: VICTIM_COST},
        "decode-c": {DELETION_COST: "0"},
    }
    # Up: no pod is touched.
    state.calls.clear()
    target.scale(Role.DECODE, 4)
    assert state.calls == [("GET", SCALE), ("PATCH", SCALE)]
    assert state.replicas["rel-pdserve-decode"] == 4


def test_the_autoscaler_grows_the_decode_pool_under_load(
    cluster: tuple[ApiState, KubernetesTarget],
) -> None:
    state, target = cluster
    policy = ScalingPolicy(slo_ttft_s=1.0, slo_tpot_s=0.05, interval_s=30.0)
    # The routers' totals: 40 requests/s of 512+64 tokens over 30 s, at the latencies the
    # profile expects (TTFT 0.0612 s for one 512-token step; TPOT 0.019 s at the batch of 9
    # this load puts on each of 3 decode workers): corrections 1.
    readings = iter([
        {"router": Totals(0.0)},
        {"router": Totals(30.0, 1200, 1200, 1200 * 512, 1200 * 64, 1200 * 0.0612, 1200,
                          1200 * 0.019, 1200)},
    ])  # fmt: skip
    times = iter([0.0, 30.0])
    scaler = Autoscaler(
        PROFILE, policy, lambda now_s: next(readings), target, clock=lambda: next(times)
    )
    assert scaler.tick() == []  # the first reading only starts the interval
    ups = {"pool": "decode", "reason": "up"}
    before = REGISTRY.get_sample_value("pdserve_planner_decisions_total", ups) or 0.0
    decisions = {d.pool: d for d in scaler.tick()}
    assert (decisions[Role.DECODE].target, decisions[Role.DECODE].reason) == (5, Reason.UP)
    assert (decisions[Role.PREFILL].target, decisions[Role.PREFILL].reason) == (3, Reason.UP)
    assert state.replicas == {"rel-pdserve-prefill": 3, "rel-pdserve-decode": 5}
    assert scaler.states[Role.DECODE].replicas == 5
    # Decisions as metrics: desired and set sizes, the predicted rate, the reason counted.
    assert REGISTRY.get_sample_value("pdserve_planner_decisions_total", ups) == before + 1
    assert REGISTRY.get_sample_value("pdserve_planner_replicas", {"pool": "decode"}) == 5
    assert REGISTRY.get_sample_value("pdserve_planner_predicted_rate") == pytest.approx(40.0)
