"""Where the autoscaler's decisions go: a small ABC and its Kubernetes implementation.

``ScaleTarget`` contract: the autoscaler (one thread, ``autoscaler.py``) calls ``replicas``
once per pool at start and ``scale`` only when a decision changes a pool's size. ``scale``
owns the scale-down: it chooses which workers go (the least loaded) and ends them through
their own drain path, so a scale-down drops no stream; the target frees nothing else.

``KubernetesTarget`` (the official ``kubernetes`` client): reads and patches each pool's
Deployment ``scale`` subresource. Before a scale-down it lists the pool's running pods, reads
each one's load from its ``/metrics`` (running + waiting requests, and leased KV on prefill),
sets ``controller.kubernetes.io/pod-deletion-cost`` on the least-loaded ones so the
ReplicaSet deletes exactly those, then patches the scale; the pods drain through their
preStop hook and SIGTERM (the chart's).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.capacity.load_meter import (
    PoolPressure,
    gauges_at,
    pool_pressure,
    reachable_gauges,
)
from pdserve.common.role import WORKER_ROLES, Role
from pdserve.common.tls import TlsConfig

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_COST = "-1000"  # below every other pod's (0 when unset): deleted first
SCALE_TIMEOUT_S = 600.0  # a scale-up waits for new workers to load their model
API_TIMEOUT_S = 30.0  # every API server call is bounded; a failed round is retried next interval
LOAD_GAUGES = ("pdserve_running_requests", "pdserve_queue_depth", "pdserve_leased_requests")


class ScaleTarget(ABC):
    @abstractmethod
    def replicas(self, pool: Role) -> int:
        """The pool's current desired size."""

    @abstractmethod
    def scale(self, pool: Role, replicas: int) -> None:
        """Sets the pool's size; a scale-down removes the least-loaded workers by draining."""

    def worker_metrics_urls(self, pool: Role) -> list[str]:
        """The ``/metrics`` URLs of the pool's live workers: the autoscaler reads the pools'
        state (KV usage, queue) there when it reads no Prometheus. []: not known."""
        return []


@dataclass(frozen=True)
class PoolRef:
    deployment: str
    label_selector: str  # the pool's pods (the release's and the role's labels)
    metrics_port: int


def pool_pressure_of(target: ScaleTarget) -> PoolPressure:
    """The pools' state from the pages of the target's live workers (those that answer)."""
    pages = {pool: reachable_gauges(target.worker_metrics_urls(pool)) for pool in WORKER_ROLES}
    return pool_pressure(pages[Role.PREFILL], pages[Role.DECODE])


def choose_victims(loads: Mapping[str, float], num: int) -> list[str]:
    """The ``num`` least-loaded pods, ties by name (pure)."""
    return sorted(loads, key=lambda name: (loads[name], name))[:num]


def pod_load(pod_ip: str, metrics_port: int) -> float:
    """Requests a worker holds; unreachable: infinite (never chosen to go)."""
    gauges = gauges_at(f"http://{pod_ip}:{metrics_port}/metrics")
    if gauges is None:
        logger.warning("pod %s: no metrics page at port %d", pod_ip, metrics_port)
        return float("inf")
    return sum(gauges.get(name, 0.0) for name in LOAD_GAUGES)


class KubernetesTarget(ScaleTarget):
    def __init__(
        self,
        apps: Any,  # kubernetes.client.AppsV1Api
        core: Any,  # kubernetes.client.CoreV1Api
        namespace: str,
        pools: Mapping[Role, PoolRef],
        load_of: Callable[[str, int], float] = pod_load,
    ) -> None:
        self.apps, self.core, self.namespace = apps, core, namespace
        self.pools = dict(pools)
        self.load_of = load_of

    def replicas(self, pool: Role) -> int:
        scale = self.apps.read_namespaced_deployment_scale(
            self.pools[pool].deployment, self.namespace, _request_timeout=API_TIMEOUT_S
        )
        return int(scale.spec.replicas or 0)

    def scale(self, pool: Role, replicas: int) -> None:
        ref = self.pools[pool]
        current = self.replicas(pool)
        if replicas < current:
            self._mark_victims(ref, current - replicas)
        body = {"spec": {"replicas": replicas}}
        self.apps.patch_namespaced_deployment_scale(
            ref.deployment, self.namespace, body, _request_timeout=API_TIMEOUT_S
        )
        logger.info("%s: %s replicas %d -> %d", pool.value, ref.deployment, current, replicas)

    def _running(self, label_selector: str) -> list[Any]:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=label_selector, _request_timeout=API_TIMEOUT_S
        ).items
        return [
            p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
        ]

    def metrics_urls(self, label_selector: str, port: int) -> list[str]:
        """Every running pod's /metrics (each router replica: a Service would pick one)."""
        return [f"http://{p.status.pod_ip}:{port}/metrics" for p in self._running(label_selector)]

    def worker_metrics_urls(self, pool: Role) -> list[str]:
        ref = self.pools[pool]
        return self.metrics_urls(ref.label_selector, ref.metrics_port)

    def _mark_victims(self, ref: PoolRef, num: int) -> None:
        running = self._running(ref.label_selector)
        loads = {p.metadata.name: self.load_of(p.status.pod_ip, ref.metrics_port) for p in running}
        victims = choose_victims(loads, num)
        for pod in running:  # a mark left by an earlier scale-down must not pick for this one
            marked = (pod.metadata.annotations or {}).get(DELETION_COST) == VICTIM_COST
            if marked and pod.metadata.name not in victims:
                # "0": the cost of an unmarked pod (a merge patch's null is not a valid string
                # in the Pod model the client and the API server validate against).
                unmark: dict[str, Any] = {"metadata": {"annotations": {DELETION_COST: "0"}}}
                self.core.patch_namespaced_pod(
                    pod.metadata.name, self.namespace, unmark, _request_timeout=API_TIMEOUT_S
                )
        for name in victims:
            body: dict[str, Any] = {"metadata": {"annotations": {DELETION_COST: VICTIM_COST}}}
            self.core.patch_namespaced_pod(
                name, self.namespace, body, _request_timeout=API_TIMEOUT_S
            )
            logger.info("pod %s (load %g) marked to go first", name, loads[name])


class LocalTarget(ScaleTarget):
    """A ``pdserve up`` cluster, through its supervisor's control RPC (``--control-port``):
    the supervisor picks and drains the least-loaded workers itself."""

    def __init__(
        self,
        address: str,
        timeout_s: float = SCALE_TIMEOUT_S,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        """``token``: the control token of a plaintext ``pdserve up`` (its printed file)."""
        import grpc

        from pdserve.v1 import control_pb2_grpc

        self._metadata = (("x-pdserve-control-token", token),) if token else ()
        if tls is None:
            self._channel = grpc.insecure_channel(address)
        else:  # the cluster's CA and a certificate it signed (pdserve up --tls-*)
            credentials = tls.channel_credentials()
            self._channel = grpc.secure_channel(address, credentials, tls.channel_options())
        self._stub = control_pb2_grpc.ClusterControlStub(self._channel)
        self.timeout_s = timeout_s  # a scale-up waits for new workers to load their model

    def pools(self) -> Any:
        from pdserve.v1 import control_pb2

        request = control_pb2.GetPoolsRequest()
        return self._stub.GetPools(request, timeout=30.0, metadata=self._metadata)

    def replicas(self, pool: Role) -> int:
        return next(p.replicas for p in self.pools().pools if p.pool == pool.value)

    def scale(self, pool: Role, replicas: int) -> None:
        from pdserve.v1 import control_pb2

        request = control_pb2.ScalePoolRequest(pool=pool.value, replicas=replicas)
        self._stub.ScalePool(request, timeout=self.timeout_s, metadata=self._metadata)
        logger.info("%s: set to %d replicas", pool.value, replicas)

    def router_metrics_url(self) -> str:
        return f"http://{self.pools().router_metrics_address}/metrics"

    def worker_metrics_urls(self, pool: Role) -> list[str]:
        sizes = next(p for p in self.pools().pools if p.pool == pool.value)
        return [f"http://{address}/metrics" for address in sizes.metrics_addresses]

    def close(self) -> None:
        self._channel.close()


class RayTarget(ScaleTarget):
    """A ``pdserve ray up`` deployment: the operation ``pdserve ray scale`` performs (its
    controller drains the workers it removes before they are killed)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def replicas(self, pool: Role) -> int:
        from app.ray_deploy import deployment

        return sum(1 for i in deployment.status(self.namespace) if i.role is pool)

    def scale(self, pool: Role, replicas: int) -> None:
        from app.ray_deploy import deployment

        deployment.scale(self.namespace, pool, replicas, timeout_s=SCALE_TIMEOUT_S)
        logger.info(
            "%s: set to %d replicas (ray namespace %s)", pool.value, replicas, self.namespace
        )

    def router_metrics_url(self) -> str:
        from app.ray_deploy import deployment

        router = next(i for i in deployment.status(self.namespace) if i.role is Role.ROUTER)
        return f"http://{router.metrics_address}/metrics"

    def worker_metrics_urls(self, pool: Role) -> list[str]:
        from app.ray_deploy import deployment

        infos = deployment.status(self.namespace)  # a restarting actor has no address yet
        return [
            f"http://{i.metrics_address}/metrics"
            for i in infos
            if i.role is pool and i.metrics_address
        ]


def kubernetes_target(
    namespace: str, pools: Mapping[Role, PoolRef], kubeconfig: str | None = None
) -> KubernetesTarget:
    """In-cluster config when running in a pod, else ``kubeconfig`` (or the default one)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    return KubernetesTarget(client.AppsV1Api(), client.CoreV1Api(), namespace, pools)
