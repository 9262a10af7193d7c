"""A component's plain-HTTP port (``--metrics-port``): ``/metrics`` (Prometheus), ``/healthz``
(200 while the process serves, else 503: a readiness probe for ports whose gRPC health needs a
client certificate) and ``/livez`` (200 while its engine progresses, else 503: a liveness probe
that sees a stuck engine, which a TCP check does not).

It must answer the kubelet's probes whatever else connects to it (a port scanner, a
neighbour's slowloris): a failed liveness probe restarts a healthy worker. So one thread runs
an asyncio loop (no thread per connection), every connection has ``REQUEST_S`` from its accept
to send its whole request head (a head trickled a byte at a time included) and as long again
to take the answer, else it is closed; and at most ``MAX_WAITING`` connections may wait for
their head at once: past that, the one waiting longest is closed, so a probe, whose request
arrives whole at once, is never crowded out. One request per connection (``Connection:
close``), as probes and scrapers send them. Closed connections count in
``pdserve_metrics_connections_closed_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

logger = logging.getLogger(__name__)

REQUEST_S = 5.0  # from accept to a whole request head; as long again for the answer
MAX_WAITING = 64  # connections waiting for their head; past it the oldest is closed
MAX_HEAD_BYTES = 8 << 10  # a probe's or a scrape's head is a few hundred bytes
_BACKLOG = 128  # a burst's SYNs wait here instead of being dropped (and retried in seconds)
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}

CLOSED = Counter(
    "pdserve_metrics_connections_closed_total",
    "Connections to the metrics port closed unanswered: no whole request head within "
    f"{REQUEST_S:g} s (timeout), one too large (too_large), or the oldest of more than "
    f"{MAX_WAITING} waiting (evicted)",
    ["reason"],
)


def start_metrics_server(
    host: str,
    port: int,
    serving: Callable[[], bool] | None = None,
    alive: Callable[[], bool] | None = None,
) -> int:
    """Serves the port from a daemon thread of its own; returns the bound port (``port`` 0
    picks one). ``serving`` and ``alive`` answer ``/healthz`` and ``/livez`` (None: always
    200); they are called from that thread."""
    server = _MetricsServer(serving, alive)
    bound: list[int] = []
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        try:
            listening = loop.run_until_complete(
                asyncio.start_server(
                    server.handle, host, port, backlog=_BACKLOG, limit=MAX_HEAD_BYTES
                )
            )
            bound.append(listening.sockets[0].getsockname()[1])
        except BaseException as exc:  # the caller raises it
            failure.append(exc)
            return
        finally:
            ready.set()
        loop.run_forever()

    threading.Thread(target=run, name="metrics-http", daemon=True).start()
    ready.wait()
    if failure:
        raise failure[0]
    return bound[0]


class _MetricsServer:
    def __init__(
        self, serving: Callable[[], bool] | None, alive: Callable[[], bool] | None
    ) -> None:
        self._serving, self._alive = serving, alive
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._waiting[writer] = None
        while len(self._waiting) > MAX_WAITING:
            oldest, _ = self._waiting.popitem(last=False)
            CLOSED.labels("evicted").inc()
            oldest.close()
        try:
            async with asyncio.timeout(REQUEST_S):
                head = await reader.readuntil(b"\r\n\r\n")
            self._waiting.pop(writer, None)
            writer.write(self._answer(head))
            async with asyncio.timeout(REQUEST_S):  # a reader that takes nothing: bounded too
                await writer.drain()
        except TimeoutError:
            CLOSED.labels("timeout").inc()
        except asyncio.LimitOverrunError:
            CLOSED.labels("too_large").inc()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            self._waiting.pop(writer, None)
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].decode("latin-1")
        kind = "text/plain; charset=utf-8"
        if method != b"GET":
            status, body = 405, b"method not allowed"
        elif path == "/metrics":
            status, body, kind = 200, generate_latest(), CONTENT_TYPE_LATEST
        elif path == "/healthz":
            ok = self._serving is None or self._serving()
            status, body = (200, b"ok") if ok else (503, b"not serving")
        elif path == "/livez":
            ok = self._alive is None or self._alive()
            status, body = (200, b"ok") if ok else (503, b"stalled")
        else:
            status, body = 404, b"not found"
        return (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
