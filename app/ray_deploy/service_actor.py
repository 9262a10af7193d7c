"""One pdserve service inside a Ray actor: the same typed config, gRPC server, health service,
registry and metrics as ``pdserve prefill|decode|router``. Ray only places the process (with
its GPUs) and restarts it; it is not a second implementation.

The service runs on its own event loop in a thread of the actor. If it ends without being asked
to (a crash), the actor process exits so that Ray restarts it, up to the actor's
``max_restarts``; the restarted service registers under a new worker id, as a fresh process would.
A configuration error (bad flags, no model at the path) would fail the same way on every
restart: the actor stays up and ``ready`` raises it, so ``pdserve ray up`` can say what is wrong.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, replace

import ray

from app.settings import ServiceConfig
from pdserve.common.role import Role
from pdserve.common.server import Service

# A loopback bind inside an actor would be unreachable from peers on other nodes.
_LOOPBACK = ("127.0.0.1", "localhost", "::1")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceInfo:
    """What the deployment reports about one actor."""

    name: str  # the actor's name
    role: Role
    address: str  # gRPC host:port
    metrics_address: str  # Prometheus host:port
    worker_id: str  # registry id ("" for the router)
    pid: int
    node_ip: str


class ServiceActor:
    def __init__(self, name: str, config: ServiceConfig) -> None:
        self.name = name
        self.node_ip = ray.util.get_node_ip_address()
        # Bound to the node's cluster address, so peers on other nodes can dial it; any other
        # bind address (0.0.0.0, say) was asked for and is kept.
        if config.server.host in _LOOPBACK:
            config = replace(config, server=replace(config.server, host=self.node_ip))
        self.config = config
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._settled = threading.Event()  # ready, or ended before it
        self._error: BaseException | None = None
        self._stopping = False
        self._address = ""
        self._metrics_address = ""
        self._service: Service | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._run, name=f"{name}-service", daemon=True).start()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except (ValueError, FileNotFoundError) as exc:
            logger.error("%s: configuration error: %s", self.name, exc)
            self._error = exc
            self._stopping = True  # a restart would fail alike
        except BaseException:
            logger.exception("%s: service failed", self.name)
        self._ended.set()
        self._settled.set()
        if not self._stopping:
            logger.error("%s: service ended unasked; exiting so that Ray restarts it", self.name)
            os._exit(1)

    async def _serve(self) -> None:
        from app.components import build_service
        from pdserve.common.metrics_server import start_metrics_server
        from pdserve.common.server import serve

        spec = build_service(self.config)
        self._service = spec.service
        self._loop = asyncio.get_running_loop()
        if spec.server.metrics_port is not None:
            port = start_metrics_server(
                spec.server.host,
                spec.server.metrics_port,
                lambda: spec.service.serving,
                spec.service.alive,
            )
            self._metrics_address = f"{spec.server.host}:{port}"

        def on_event(event: str, address: str) -> None:
            if event == "ready":
                self._address = address
                self._ready.set()
                self._settled.set()

        await serve(
            spec.service, spec.server, reflect=spec.reflect, on_event=on_event, signals=False
        )

    def ready(self, timeout_s: float) -> ServiceInfo:
        """Blocks until the service is healthy; its configuration error, or TimeoutError."""
        if not self._settled.wait(timeout_s):
            raise TimeoutError(f"{self.name} not ready within {timeout_s} s")
        if self._error is not None:
            raise ValueError(f"{self.name}: {self._error}")
        return self.info()

    def info(self) -> ServiceInfo:
        from app.settings import role_of

        role = role_of(self.config)
        worker_id = str(getattr(self._service, "worker_id", ""))
        return ServiceInfo(
            self.name,
            role,
            self._address,
            self._metrics_address,
            worker_id,
            os.getpid(),
            self.node_ip,
        )

    def drain(self, timeout_s: float) -> bool:
        """The same graceful stop as SIGTERM in process mode: health NOT_SERVING, no new work,
        in-flight work finishes, deregister. True once the service has stopped."""
        self._stopping = True
        self._settled.wait(timeout_s)  # a loading service is stopped once it can be
        if self._ended.is_set():
            return True
        loop, service = self._loop, self._service
        if loop is not None and service is not None and service.request_stop is not None:
            loop.call_soon_threadsafe(service.request_stop)
        return self._ended.wait(timeout_s)
