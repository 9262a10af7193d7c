"""The router's HTTP listener: uvicorn serving the OpenAI app on the router's own event loop
(no extra process, no extra hop), started before the model loads (``/health`` answers 503
until then) and stopped after the drain.

TLS, when the router has it, is server-only (API keys authenticate clients), from the same
certificate files as the gRPC port. uvicorn reads them once; here a change of the files (a
cert-manager renewal) is looked for every ``CERT_RECHECK_S`` and loaded into the live SSL
context, so new connections get the new certificate without a restart (open ones keep theirs).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from fastapi import FastAPI

from pdserve.common.tls import TlsConfig
from router.limits import RequestLimits
from router.openai.http_protocol import bounded_protocol

logger = logging.getLogger(__name__)

CERT_RECHECK_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, listening with a bound on TLS handshakes (asyncio's default lets one
    that never ends hold its socket for a minute), on the sockets ``HttpServer`` bound. No
    lifespan (the router's own start and drain are the lifecycle) and no signal handlers."""

    def __init__(self, config: uvicorn.Config, handshake_timeout_s: float) -> None:
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        self.lifespan = config.lifespan_class(config)

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        loop = asyncio.get_running_loop()
        handshake_s = self.handshake_timeout_s if config.ssl is not None else None
        self.servers = [
            await loop.create_server(
                protocol,
                sock=sock,
                ssl=config.ssl,
                backlog=config.backlog,
                ssl_handshake_timeout=handshake_s,
            )
            for sock in sockets or ()
        ]
        self.started = True


class HttpServer:
    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        tls: TlsConfig | None,
        limits: RequestLimits,
        limit_concurrency: int | None = None,
    ) -> None:
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=bounded_protocol(
                limits.max_header_bytes,
                limits.request_header_timeout_s,
                limits.max_idle_connections,
            ),
            limit_concurrency=limit_concurrency,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,
            ssl_certfile=tls.cert_file if tls is not None else None,
            ssl_keyfile=tls.key_file if tls is not None else None,
        )
        self._server = _Server(self.config, handshake_timeout_s=limits.request_header_timeout_s)
        self._tls = tls
        self._task: asyncio.Task[None] | None = None
        self._cert_watch: asyncio.Task[None] | None = None
        self._sockets: list[socket.socket] = []
        self.address = ""

    async def start(self) -> str:
        """Binds (port 0: an ephemeral one) and listens; then serves in the background. The
        bound address. (uvicorn's ``serve`` split in its steps: it would also take the
        process's signals, which belong to the router's drain.)"""
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and
        # without it an SSE event waits behind the headers for a delayed ACK (~40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.config.host, self.config.port))
        self._sockets = [sock]
        self.config.load()
        await self._server.startup(sockets=self._sockets)
        if not self._server.started:
            raise OSError(f"http: could not listen on {self.config.host}:{self.config.port}")
        self._task = asyncio.create_task(self._server.main_loop(), name="http")
        if self._tls is not None:
            self._cert_watch = asyncio.create_task(self._watch_certificates(self._tls))
        port = sock.getsockname()[1]
        host = f"[{self.config.host}]" if family == socket.AF_INET6 else self.config.host
        self.address = f"{host}:{port}"
        return self.address

    async def _watch_certificates(self, tls: TlsConfig) -> None:
        seen = tls.mtimes()
        while True:
            await asyncio.sleep(CERT_RECHECK_S)
            try:
                now = tls.mtimes()
                if now == seen:
                    continue
                assert self.config.ssl is not None
                # The same context, new chain: later handshakes present it.
                self.config.ssl.load_cert_chain(tls.cert_file, tls.key_file)
            except (OSError, ValueError) as exc:  # files mid-swap: look again next time
                logger.warning("http: certificate not reloaded yet: %s", exc)
                continue
            seen = now
            logger.info("http: certificate reloaded from %s", tls.cert_file)

    async def stop(self) -> None:
        """Stops accepting, lets open responses finish briefly (the drain already waited for
        the requests), closes."""
        if self._cert_watch is not None:
            self._cert_watch.cancel()
            await asyncio.gather(self._cert_watch, return_exceptions=True)
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        await self._server.shutdown(sockets=self._sockets)
        self._task = None
