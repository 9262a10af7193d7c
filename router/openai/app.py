"""The OpenAI-compatible HTTP API of the router, as a FastAPI app (what vLLM and SGLang serve):
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``; ``GET /health``
(503 while loading or draining) and ``GET /metrics`` (the process's Prometheus registry).

Every ``/v1/*`` route and ``/metrics`` need the API key when keys are configured; health does not.
A body is counted as it arrives and refused (413) past ``--max-request-bytes`` before any
parsing; a large one is parsed off the event loop. Errors have OpenAI's shape
(``router/openai/errors.py``); a bug answers 500 with the request id only, its traceback logged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.common import metrics
from router.openai import errors
from router.openai.client_gone import ClientGone, until
from router.openai.http_body import read_json
from router.openai.parsing import parse
from router.openai.prepare import Arrival, new_client_id, prepare
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.served_model import ServedModel
from router.openai.serving import collect, start_stream
from router.openai.sse import BoundedResponse, EventStream
from router.prompts import Overloaded
from router.request_core import RequestCore

logger = logging.getLogger(__name__)
OpenAIBody = ChatCompletionRequest | CompletionRequest

_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def error_response(
    error: errors.ApiError, request: Request, request_id: str | None = None
) -> JSONResponse:
    metrics.REQUEST_ERRORS.labels(_CODE_NAMES.get(error.status, "INTERNAL")).inc()
    headers = error.headers()
    if request_id:
        headers["x-request-id"] = request_id
    if carries_body(request):
        # A refusal may leave body bytes unread (the key, the load and the size are checked
        # before the body is read, on purpose): the server then closes the connection after
        # the response, and a client told keep-alive reuses it and its next request is reset.
        headers["Connection"] = "close"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def carries_body(request: Request) -> bool:
    """Whether the request came with a body (a length above zero, or chunks)."""
    length = request.headers.get("content-length")
    return "transfer-encoding" in request.headers or (length is not None and length != "0")


# pdserve_request_errors_total counts refusals by gRPC code name, for both frontends.
_CODE_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
}


class _CountRequests:
    """``pdserve_http_requests_total{route, status}`` for every response (routes bounded)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                metrics.HTTP_REQUESTS.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def build_app(core: RequestCore, served_model_name: str) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    served = ServedModel.load(core.config, core.tokenizer, served_model_name)
    created = int(time.time())

    @app.exception_handler(errors.ApiError)
    async def api_error(request: Request, exc: errors.ApiError) -> JSONResponse:
        return error_response(exc, request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(errors.ApiError(exc.status_code, str(exc.detail), kind), request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if core.lifecycle.serving else 503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        # The public port is outside the metrics NetworkPolicy: here, the API key guards it
        # (operators scrape the metrics port, where the policy applies).
        if not core.authorized(request.headers.get("authorization")):
            raise errors.unauthorized()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def gate(request: Request) -> None:
        """The checks before any work: the key, then whether this router takes requests."""
        if not core.authorized(request.headers.get("authorization")):
            raise errors.unauthorized()
        refusal = core.refusal()
        if refusal is not None:
            raise errors.unavailable(refusal)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gate(request)
        card: dict[str, Any] = {
            "id": served.name,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "root": served.name,  # never the model's path on the router's disk
            "max_model_len": core.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def run(request: Request, kind: type[OpenAIBody]) -> Response:
        """One request: the gate, then its count in flight, from here to its last byte (a
        drain waits for it)."""
        start_s = time.perf_counter()
        gate(request)
        try:
            inflight = core.track()
        except Overloaded as exc:
            error = errors.from_exception(exc)
            assert error is not None
            return error_response(error, request)
        try:
            return await respond(request, kind, start_s)
        finally:
            inflight.end()

    async def respond(request: Request, kind: type[OpenAIBody], start_s: float) -> Response:
        """Its stages in order: its body (refused through the app's handler), what it asks
        for (``parsing.py``), its choices (``prepare.py``), its response (``serving.py``) as
        one body or an event stream (``sse.py``)."""
        body = await read_json(request, kind, core.config.limits)
        client_id = new_client_id(request.headers.get("x-request-id"))
        headers = {"x-request-id": client_id}
        idle_s = core.config.client_idle_timeout_s
        host = request.client.host if request.client is not None else ""
        try:
            try:
                header = core.config.flow.fairness_header
                tenant = core.tenant(
                    request.headers.get("authorization"),
                    host,
                    request.headers.get(header) if header is not None else None,
                )
                arrival = Arrival(client_id, tenant, start_s)
                parsed = await parse(core, served, body)
                prepared = await prepare(core, parsed, arrival)
            except ValueError as exc:  # the request's reading: a check naming its field
                raise errors.refusal(exc) from None
            if prepared.asked.stream:
                started = await until(request.receive, start_stream(core, served, prepared))
                # The stream's own count: it outlives this handler.
                counted = core.track(bounded=False)
                return EventStream(
                    started.events, started.close, idle_s, client_id, headers, counted.end
                )
            result = await until(request.receive, collect(core, served, prepared))
            return BoundedResponse(result, idle_s, headers)
        except ClientGone:
            logger.info("request_id=%s: the client left before its response", client_id)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed")
        except Exception as exc:
            error = errors.from_exception(exc)
            if error is None:
                logger.exception("request_id=%s failed", client_id)
                error = errors.internal(client_id)
            return error_response(error, request, client_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await run(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await run(request, CompletionRequest)

    app.add_middleware(_CountRequests)
    return app
