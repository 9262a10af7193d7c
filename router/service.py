"""The public ``pdserve.v1.Router`` service: the router's process and its gRPC frontend.

It owns the request core (``router/request_core.py``), which the OpenAI HTTP app it starts
(``router/openai``) shares. Per request: the API key, whether the router takes requests, the
body parsed (a large one off the event loop), the core's validation, then the core's responses
written to the client, each write bounded by the client idle timeout.

Lease ownership: see ``router/dispatch.py`` (the contract is in ``kvtransfer/base.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from pdserve.common import metrics
from pdserve.common.auth import bearer
from pdserve.common.server import Service
from pdserve.v1 import router_pb2
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.generation import Generation
from router.grpc_wire import Unparsable, parse_request, request_from_proto, result_to_proto
from router.prompts import Overloaded
from router.request_core import RequestCore, ResourceError
from router.worker_errors import WorkerError
from router.worker_pool import WorkerPool

if TYPE_CHECKING:
    from router.openai.server import HttpServer

logger = logging.getLogger(__name__)

_PARSE_IN_THREAD_BYTES = 64 << 10


# HTTP connections allowed beyond --max-concurrent-requests (keep-alives between requests).
HTTP_SPARE_CONNECTIONS = 256


class RouterService(Service):
    name = "pdserve.v1.Router"
    public = True  # TLS without client certificates: API keys authenticate clients
    trace_name = "pdserve-router"
    roots_traces = True  # a request's trace starts here (pdserve/common/tracing.py)

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.max_request_bytes = config.limits.max_request_bytes  # gRPC refuses larger bodies
        self.core = RequestCore(config, self)
        self._http: HttpServer | None = None

    def register(self, server: grpc.aio.Server) -> None:
        # Raw bytes in: the body is parsed only once the caller proved its key.
        handler = grpc.unary_stream_rpc_method_handler(
            self.Generate,
            request_deserializer=None,
            response_serializer=router_pb2.GenerateResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(self.name, {"Generate": handler}),)
        )

    @property
    def pool(self) -> WorkerPool:
        return self.core.pool

    @property
    def generation(self) -> Generation:
        return self.core.generation

    @property
    def dispatch(self) -> Dispatcher:
        return self.core.generation.dispatch

    async def open(self) -> dict[str, str]:
        """The OpenAI HTTP API, when ``http_port`` is set (router/openai)."""
        if self.config.http_port is None:
            return {}
        # Imported here: FastAPI and uvicorn load only in routers that serve HTTP.
        from router.openai.app import build_app
        from router.openai.server import HttpServer

        server = self.config.server
        app = build_app(self.core, self.config.model_name)
        # Connections (idle keep-alives and slow senders too) are bounded past the requests
        # the router admits: uvicorn answers 503 beyond, the router's own check 429 before.
        connections = self.config.limits.max_concurrent_requests + HTTP_SPARE_CONNECTIONS
        self._http = HttpServer(
            app, server.host, self.config.http_port, server.tls, self.config.limits, connections
        )
        return {"http": await self._http.start()}

    async def load(self) -> None:
        await self.core.load()

    def num_inflight(self) -> int:
        return self.core.num_inflight()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.stop()
        await self.core.close()

    async def Generate(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        """A server stream written with ``context.write`` (not yielded): each write is bounded
        by ``client_idle_timeout_s``, so a client that stops reading is cancelled, and what it
        held on the workers freed, instead of pinning them forever."""
        try:
            inflight = self.core.track()
        except Overloaded as exc:
            metrics.REQUEST_ERRORS.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        with inflight:
            await self._generate(data, context)

    async def _generate(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        start_s = time.perf_counter()
        core = self.core
        authorization = bearer(context.invocation_metadata())
        if not core.authorized(authorization):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required: metadata authorization: Bearer <key>",
            )
        refusal = core.refusal()
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        # A large body is parsed off the event loop (megabytes of ids take milliseconds).
        parsed = (
            parse_request(data)
            if len(data) < _PARSE_IN_THREAD_BYTES
            else await asyncio.to_thread(parse_request, data)
        )
        if isinstance(parsed, Unparsable):
            metrics.REQUEST_ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed.message)
        assert isinstance(parsed, router_pb2.GenerateRequest)
        client_id = parsed.request_id or uuid.uuid4().hex
        metadata = context.invocation_metadata()
        try:
            header = _metadata(metadata, self.config.flow.fairness_header)
            tenant = core.tenant(authorization, context.peer(), header)
            limits, max_model_len = self.config.limits, core.max_model_len
            asked = request_from_proto(parsed, client_id, tenant, start_s, limits, max_model_len)
            request = await core.read(asked)
        except (ResourceError, Overloaded) as exc:
            metrics.REQUEST_ERRORS.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            metrics.REQUEST_ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        stream = core.responses(request)
        try:
            async with contextlib.aclosing(stream):
                async for result in stream:
                    async with asyncio.timeout(self.config.client_idle_timeout_s):
                        await context.write(result_to_proto(result))
        except TimeoutError:
            metrics.CLIENT_IDLE_CANCELS.inc()
            logger.warning(
                "request_id=%s cancelled: the client read nothing for %.0f s",
                client_id,
                self.config.client_idle_timeout_s,
            )
            await context.abort(
                grpc.StatusCode.CANCELLED,
                f"the client read nothing for client_idle_timeout_s="
                f"{self.config.client_idle_timeout_s}",
            )
        except Overloaded as exc:  # flow control's: before any response
            code = grpc.StatusCode.UNAVAILABLE if exc.unavailable else _RESOURCE_EXHAUSTED
            metrics.REQUEST_ERRORS.labels(code.name).inc()
            retry = (("retry-after", str(exc.retry_after_s)),)
            await context.abort(code, str(exc), trailing_metadata=retry)
        except WorkerError as exc:
            await context.abort(exc.code, exc.message)


_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _metadata(metadata: Sequence[tuple[str, str | bytes]] | None, name: str | None) -> str | None:
    """The value of the (text) metadata entry ``name`` (None: no name, or not sent)."""
    if name is None:
        return None
    for key, value in metadata or ():
        if key == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None
