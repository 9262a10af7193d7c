"""uvicorn's httptools protocol with bounds on a request's head (request line and headers)
and on connections that carry no request.

llhttp, under httptools, sets no size limit and uvicorn no time limit on the head: measured, a
10 MB header or 100 000 headers were accepted, and a head trickled a byte at a time holds a
connection for ever. Here the head must be complete within ``max_header_bytes`` (else 431) and
``header_timeout_s`` (else 408) from the connection's start (its accept, or its TLS handshake,
itself bounded by that long: ``router/openai/server.py``) or from its next request's first byte
on a kept-alive connection; both answers close it. A connection that sends nothing is closed
the same way: uvicorn would hold it, counted in its ``limit_concurrency``, for ever. And at
most ``max_idle_connections`` may wait for a head at once: past that the oldest one waiting is
closed, so a flood of silent or trickling sockets cannot crowd out clients whose request
arrives at once. These run before routing and authentication, so they bound what an anonymous
client can make us hold. A response sent before its request's body has all arrived (a 408 or
413 refusal of that body) closes the connection too: the rest of the body would otherwise keep
it open for ever. (uvicorn's h11 path has a 16 KiB bound of its own but parses in Python;
httptools is kept.)
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.common import metrics

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 << 10  # set per server by ``bounded_protocol``
    header_timeout_s = 10.0
    max_idle_connections = 1024
    # The server's connections waiting for a head, oldest first (one table per server class).
    waiting: OrderedDict[BoundedHttpToolsProtocol, None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # no head seen complete since the last message (or the start)
        self._head_bytes = 0
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # From the start: a connection that never sends a byte is bounded too.
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)
        self._wait_for_head()

    def _wait_for_head(self) -> None:
        """Counts this connection among those waiting for a head; past the bound, the one
        that has waited longest goes (a slow or silent sender, never a prompt one)."""
        waiting = self.waiting
        waiting[self] = None
        while len(waiting) > self.max_idle_connections:
            oldest, _ = waiting.popitem(last=False)
            metrics.HTTP_IDLE_EVICTED.inc()
            oldest.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_head and self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)
        head_before = self._in_head
        super().data_received(data)
        if head_before and self._in_head:  # the whole chunk was head: count it
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(
                    431, f"request head exceeds --max-header-bytes {self.max_header_bytes}"
                )

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_deadline()
        self.waiting.pop(self, None)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # the next request on this connection

    def on_response_complete(self) -> None:
        cycle = self.cycle  # the one answered, unless a pipelined request has replaced it
        answered_early = cycle is not None and cycle.response_complete and cycle.more_body
        if answered_early and not self.transport.is_closing():
            # Answered before the body arrived whole. uvicorn would keep the connection alive,
            # but every later byte of that body cancels the keep-alive timer it arms here and
            # nothing arms it again: a trickling client would hold the connection for ever.
            self.transport.close()
        super().on_response_complete()
        if not self.transport.is_closing():
            self._wait_for_head()  # kept alive: waiting for its next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.waiting.pop(self, None)
        super().connection_lost(exc)

    def _cancel_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _too_slow(self) -> None:
        self._head_deadline = None
        if self._in_head:
            limit = f"--request-header-timeout-s {self.header_timeout_s:g}"
            self._refuse(408, f"request head not complete within {limit}")

    def _refuse(self, status: int, why: str) -> None:
        if self.transport.is_closing():
            return
        metrics.HTTP_HEAD_REFUSED.labels(str(status)).inc()
        body = why.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()


def bounded_protocol(
    max_header_bytes: int, header_timeout_s: float, max_idle_connections: int
) -> type[HttpToolsProtocol]:
    """The protocol class uvicorn is given (``http=``): the bounds (and the table of
    connections waiting for a head) are per server."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {
            "max_header_bytes": max_header_bytes,
            "header_timeout_s": header_timeout_s,
            "max_idle_connections": max_idle_connections,
            "waiting": OrderedDict(),
        },
    )
