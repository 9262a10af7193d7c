"""The lifecycle every pdserve service shares.

grpc.aio server with the standard health service: NOT_SERVING while the model and KV cache load,
SERVING once ready, NOT_SERVING again on SIGTERM/SIGINT. Then a graceful drain (no new work,
in-flight requests finish, bounded by ``drain_timeout_s``), then stop.
"""

from __future__ import annotations

import asyncio
import io
import logging
import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.common import peer_token, tracing
from pdserve.common.channels import SERVER_OPTIONS
from pdserve.common.tls import TlsConfig, add_port, is_loopback
from pdserve.common.tracing import TracingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, reported once bound
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off, 0: ephemeral
    advertise_host: str | None = None  # the host peers dial (default: host)
    drain_timeout_s: float = 30.0
    # TLS for this component's ports and its calls to peers (pdserve/common/tls.py). Without
    # it, traffic is plaintext, which is allowed on a loopback address only, unless insecure.
    tls: TlsConfig | None = None
    insecure: bool = False
    # HTTP/2 pings to the callers of open calls this often, each answered within as long: a
    # caller gone silent (a frozen router, a partition without a reset) has its calls
    # cancelled, and what they held freed, within 2 x keepalive_s (gRPC's default: 2 hours).
    keepalive_s: float = 20.0
    # The cluster's token for internal calls (pdserve/common/peer_token.py): internal ports
    # refuse calls without it, and this component sends it on its own. "": none.
    peer_token: str = field(default="", repr=False)
    # Request traces (pdserve/common/tracing.py); off unless it names a collector.
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        if self.tls is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host} is not a loopback address: serving it in plaintext needs "
                "--insecure (or --tls-cert, --tls-key and --tls-ca)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.keepalive_s >= 1:
            raise ValueError(f"keepalive_s must be >= 1, got {self.keepalive_s}")


# The trailer of a call a component refused because it is draining or still loading: nothing
# ran, so the caller tries another (router/failures.py, Seen.NOT_ACCEPTING), no failure.
NOT_ACCEPTING = ("pdserve-not-accepting", "1")


class Service(ABC):
    """One pdserve component. ``serve`` calls, in order: register, load, (serve), drain, close."""

    name: str  # fully qualified gRPC service name, for health and reflection
    # A public port (the router's) serves TLS without asking clients for a certificate (API
    # keys authenticate them); internal ports require one signed by the cluster's CA.
    public: bool = False
    # The largest request message this service accepts (gRPC refuses larger ones with
    # RESOURCE_EXHAUSTED before anything is parsed); None: the internal default.
    max_request_bytes: int | None = None
    draining: bool = False
    serving: bool = False  # health SERVING (loaded, not draining)
    address: str = ""  # host:port peers use to reach this service (set once bound)
    # Set by ``serve``: starts the same graceful shutdown as SIGTERM (e.g. a drain request).
    request_stop: Callable[[], None] | None = None
    # Why the service stopped itself (a dead engine); the process then exits non-zero.
    failure: BaseException | None = None
    # Its name in traces (``service.name`` of its spans), and whether it starts them.
    trace_name: str = "pdserve"
    roots_traces: bool = False

    @abstractmethod
    def register(self, server: grpc.aio.Server) -> None: ...

    @abstractmethod
    async def load(self) -> None:
        """Heavy start-up (model, KV cache, peers). Health turns SERVING when it returns."""

    @abstractmethod
    def num_inflight(self) -> int: ...

    def alive(self) -> bool:
        """Liveness (``/livez``): False when the process should be restarted although it
        answers (a stuck engine). Called from the metrics server's threads."""
        return True

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> None:
        """Refuse new work and wait for in-flight requests, up to ``timeout_s``."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_inflight() > 0 and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        if self.num_inflight():
            logger.warning("%s: drain timed out with %d in flight", self.name, self.num_inflight())

    async def open(self) -> dict[str, str]:
        """Listeners of its own besides the gRPC port (the router's HTTP API), opened once that
        port is bound and before ``load``, so their health answers "not ready" meanwhile.
        Returns {name: bound address}, announced like the gRPC port. ``close`` closes them."""
        return {}

    async def close(self) -> None:
        """Release what open() and load() acquired."""
        return None


class ServiceServer:
    def __init__(self, service: Service, config: ServerConfig, *, reflect: bool = False) -> None:
        self.service = service
        self.config = config
        keepalive_ms = int(config.keepalive_s * 1000)
        options = [
            *SERVER_OPTIONS,
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", keepalive_ms),
            # Keep pinging while no data moves (gRPC stops after 2): a frozen caller's full
            # window is exactly when no data moves. And await each ack keepalive_s only
            # (gRPC's own ping timeout is a minute, whatever the keepalive timeout says).
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_time_between_pings_ms", keepalive_ms),
            ("grpc.http2.ping_timeout_ms", keepalive_ms),
        ]
        if service.max_request_bytes is not None:
            limit = ("grpc.max_receive_message_length", service.max_request_bytes)
            options = [o for o in options if o[0] != limit[0]] + [limit]
        if config.peer_token:
            peer_token.use(config.peer_token)  # for this process's channels to peers too
        interceptors = [] if service.public else peer_token.server_interceptors()
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        service.register(self.server)
        if reflect:
            names = (service.name, health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)
        self.address = ""
        self.listeners: dict[str, str] = {}  # the service's own (``Service.open``)

    async def start(self) -> str:
        bind = f"{self.config.host}:{self.config.port}"
        port = add_port(self.server, bind, self.config.tls, not self.service.public)
        self.address = f"{self.config.host}:{port}"
        self.service.address = f"{self.config.advertise_host or self.config.host}:{port}"
        await self._set_health(serving=False)
        await self.server.start()
        try:
            self.listeners = await self.service.open()
        except BaseException:
            await self.server.stop(grace=None)
            raise
        return self.address

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", self.service.name):
            await self.health.set(name, status)

    async def ready(self) -> None:
        await self.service.load()
        await self._set_health(serving=True)
        self.service.serving = True

    async def shutdown(self) -> None:
        self.service.serving = False
        await self.health.enter_graceful_shutdown()
        if self.service.public:
            # GOAWAY at drain start: a client on a persistent channel opens a new connection
            # (through its load balancer, to another replica) for its next call, instead of
            # being refused here until the drain ends; calls in flight go on meanwhile.
            # Internal ports keep accepting (and refusing by name: NOT_ACCEPTING) while they
            # drain: a prefill worker's leases are released by calls that arrive then.
            grace_s = self.config.drain_timeout_s + 1.0
            stopped = asyncio.create_task(self.server.stop(grace=grace_s))
            await self.service.drain(self.config.drain_timeout_s)
            await stopped
        else:
            await self.service.drain(self.config.drain_timeout_s)
            await self.server.stop(grace=1.0)
        await self.service.close()


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        stack = io.StringIO()
        task.print_stack(file=stack)
        logger.warning("task %s:\n%s", task.get_name(), stack.getvalue())


async def serve(
    service: Service,
    config: ServerConfig,
    *,
    reflect: bool = False,
    on_event: Callable[[str, str], None] = lambda event, detail: None,
    signals: bool = True,
) -> None:
    """Runs a service until SIGTERM/SIGINT (or ``service.request_stop()``). ``on_event`` hears
    ("listening", address) once bound and ("ready", address) once healthy; the CLI prints them
    for supervisors. ``signals=False`` off the main thread (a Ray actor stops it by request)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # ops: `kill -USR1` shows waits
    service.request_stop = stop.set
    tracing.configure(config.tracing, service.trace_name, service.roots_traces)
    server = ServiceServer(service, config, reflect=reflect)
    address = await server.start()
    on_event("listening", address)
    for name, listener in server.listeners.items():
        on_event(name, listener)
    load = asyncio.create_task(server.ready())
    stop_wait = asyncio.create_task(stop.wait())
    await asyncio.wait([load, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    if load.done():
        if load.exception() is not None:
            stop_wait.cancel()
            await server.server.stop(grace=None)
            await service.close()
            load.result()  # a failed load ends the process with its error
        on_event("ready", address)
        await stop_wait
    else:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    logger.info("%s: draining", service.name)
    await server.shutdown()
    await asyncio.to_thread(tracing.shutdown)  # the last spans out (bounded by the SDK)
    logger.info("%s: stopped", service.name)
