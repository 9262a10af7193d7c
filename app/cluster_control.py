"""The control RPC of a ``pdserve up`` supervisor (``--control-port``; ``ClusterControl`` in
``proto/pdserve/v1/control.proto``): ``pdserve autoscale --target local`` reads and sets the
pools' sizes through it. A scale-down drains the least-loaded workers (their own SIGTERM
drain: in-flight requests finish), which the supervisor then leaves down; a scale-up starts
workers and answers once they are ready (they join the router through Redis)."""

from __future__ import annotations

import hmac
import logging
import threading
from concurrent import futures
from typing import Any

import grpc

from app.capacity.load_meter import gauges_at
from app.capacity.scale_target import LOAD_GAUGES, choose_victims
from app.local_cluster import Component, LocalCluster
from pdserve.common.role import WORKER_ROLES, Role
from pdserve.common.tls import TlsConfig
from pdserve.v1 import control_pb2, control_pb2_grpc

logger = logging.getLogger(__name__)
POOLS = tuple(role.value for role in WORKER_ROLES)
MAX_WORKERS_PER_POOL = 64


def worker_load(worker: Component) -> float:
    """Requests a worker holds, from its /metrics; unreachable: infinite (it is not chosen)."""
    gauges = gauges_at(f"http://{worker.metrics_address}/metrics")
    if gauges is None:
        return float("inf")
    return sum(gauges.get(name, 0.0) for name in LOAD_GAUGES)


class ClusterControl(control_pb2_grpc.ClusterControlServicer):
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._scaling = threading.Lock()  # one resize at a time

    def _pools(self) -> control_pb2.PoolsResponse:
        router = self.cluster.router
        return control_pb2.PoolsResponse(
            pools=[self._pool(r) for r in WORKER_ROLES],
            router_metrics_address=router.metrics_address if router else "",
        )

    def _pool(self, role: Role) -> control_pb2.PoolSize:
        live = self.cluster.live_workers(role)
        metrics = [w.metrics_address for w in live if w.metrics_address]
        return control_pb2.PoolSize(pool=role.value, replicas=len(live), metrics_addresses=metrics)

    def GetPools(
        self, request: control_pb2.GetPoolsRequest, context: grpc.ServicerContext
    ) -> control_pb2.PoolsResponse:
        return self._pools()

    def ScalePool(
        self, request: control_pb2.ScalePoolRequest, context: grpc.ServicerContext
    ) -> control_pb2.PoolsResponse:
        if request.pool not in POOLS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pool must be one of {POOLS}")
        pool = Role(request.pool)
        if pool is Role.PREFILL and self.cluster.config.colocated:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a colocated cluster has no prefill pool (autoscale it with --max-prefill 0)",
            )
        floor = 1
        if not floor <= request.replicas <= MAX_WORKERS_PER_POOL:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replicas must be in [{floor}, {MAX_WORKERS_PER_POOL}], got {request.replicas}",
            )
        if not self.cluster.config.redis_url:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "resizing needs the registry (pdserve up with Redis): the router would not "
                "learn new workers",
            )
        with self._scaling:
            live = self.cluster.live_workers(pool)
            for _ in range(request.replicas - len(live)):
                try:
                    worker = self.cluster.add_worker(pool)
                except (RuntimeError, TimeoutError) as exc:  # failed to start, or stopping
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"pool {request.pool}: {exc}")
                logger.info("pool %s: added %s", request.pool, worker.name)
            if request.replicas < len(live):
                loads = {w.name: worker_load(w) for w in live}
                by_name = {w.name: w for w in live}
                for name in choose_victims(loads, len(live) - request.replicas):
                    logger.info("pool %s: draining %s (load %g)", request.pool, name, loads[name])
                    self.cluster.drain_worker(by_name[name])
        return self._pools()


# The metadata key of the control token (``pdserve up`` without TLS: its file's content).
TOKEN_KEY = "x-pdserve-control-token"


class _RequireToken(grpc.ServerInterceptor):
    """Without TLS, anyone on the host reaches the control port: a call must present the token
    ``pdserve up`` wrote to a file only its user can read, or it is UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        sent = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        given = sent.encode() if isinstance(sent, str) else bytes(sent)
        if handler is None or hmac.compare_digest(given, self._token):
            return handler

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the control port needs pdserve up's control token ({TOKEN_KEY}: the file "
                "`pdserve up` printed; pdserve autoscale --control-token-file)",
            )

        codecs = (handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(refuse, *codecs)


def serve_control(
    cluster: LocalCluster,
    host: str,
    port: int,
    tls: TlsConfig | None = None,
    token: str | None = None,
) -> tuple[grpc.Server, int]:
    """With ``tls`` (the cluster's ``--tls-*``): mutual TLS, so only a holder of a certificate
    from the cluster's CA can resize the pools; without, plaintext on ``host``, and every call
    must present ``token`` (``TOKEN_KEY``)."""
    interceptors = [_RequireToken(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
    control_pb2_grpc.add_ClusterControlServicer_to_server(ClusterControl(cluster), server)
    bind = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(bind)
    else:
        bound = server.add_secure_port(bind, tls.server_credentials(require_client_auth=True))
    if bound == 0:
        raise OSError(f"could not bind the control port to {bind}")
    server.start()
    return server, bound
