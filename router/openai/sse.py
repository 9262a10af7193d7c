"""Server-Sent Events for the streamed OpenAI responses: ``data: <json>\n\n`` per event, then
``data: [DONE]\n\n``.

A raw ASGI response rather than Starlette's ``StreamingResponse``, for two guarantees: a client
that disconnects is noticed at once (a task listens for ``http.disconnect``), not at the next
write, and every write is bounded by ``client_idle_timeout_s``, so a client that stops reading
is dropped. Either way the event source is closed, which cancels the request on the workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from pdserve.common import metrics
from router.openai.client_gone import disconnected

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def event(data: dict[str, Any]) -> bytes:
    """One SSE event; compact, strict JSON (never a raw newline, never NaN or Infinity:
    ``responses.finite`` clamps logprobs, and anything else non-finite is a bug that must not
    reach a client as JSON no strict parser reads)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode() + b"\n\n"


class EventStream(Response):
    """A Starlette ``Response`` (so FastAPI hands it over as is) with its own ``__call__``.
    ``close`` ends the request on the workers; it runs last, whatever happened."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        close: Callable[[], Awaitable[None]],
        idle_timeout_s: float,
        request_id: str,
        headers: dict[str, str] | None = None,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.events = events
        self.close = close
        self.on_done = on_done
        self.status_code = 200
        self.background = None
        self.idle_timeout_s = idle_timeout_s
        self.request_id = request_id
        self.extra_headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",  # proxies (nginx) must not buffer the stream
            **(headers or {}),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(bounded(send, self.idle_timeout_s)))
        watch = asyncio.create_task(disconnected(receive))
        try:
            await asyncio.wait([pump, watch], return_when=asyncio.FIRST_COMPLETED)
            gone = watch.done() and not pump.done()
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            try:
                await self.events.aclose()
                await self.close()
            finally:
                self.on_done()
        if gone:
            logger.info("request_id=%s: the client disconnected mid-stream", self.request_id)
        failure = pump.exception() if not pump.cancelled() else None
        if isinstance(failure, TimeoutError):
            metrics.CLIENT_IDLE_CANCELS.inc()
            logger.warning(
                "request_id=%s cancelled: the client read nothing for %.0f s",
                self.request_id,
                self.idle_timeout_s,
            )
        elif failure is not None and not isinstance(failure, OSError):  # OSError: client gone
            raise failure

    async def _pump(self, send: Send) -> None:
        headers = [(k.encode(), v.encode()) for k, v in self.extra_headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for data in self.events:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def bounded(send: Send, timeout_s: float) -> Send:
    """``send`` that raises TimeoutError when the client takes no byte for ``timeout_s``."""

    async def send_within(message: Message) -> None:
        async with asyncio.timeout(timeout_s):
            await send(message)

    return send_within


class BoundedResponse(Response):
    """A whole response whose writes are bounded like a stream's (a client that reads nothing
    is dropped after ``idle_timeout_s``)."""

    def __init__(self, content: bytes, idle_timeout_s: float, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="application/json", headers=headers)
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, bounded(send, self.idle_timeout_s))
        except TimeoutError:
            metrics.CLIENT_IDLE_CANCELS.inc()
            logger.warning("a client read nothing of its response for %.0f s", self.idle_timeout_s)
