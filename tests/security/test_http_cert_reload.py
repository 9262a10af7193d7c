"""The router's HTTPS certificate follows its files (a cert-manager renewal): new connections
get the renewed certificate without a restart. Before, uvicorn read it once."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from pathlib import Path

import pytest
from fastapi import FastAPI

from pdserve.common.tls import TlsConfig
from router.limits import RequestLimits
from router.openai import server as http_server
from router.openai.server import HttpServer
from tests.security.tls_util import make_pki
from tests.services.harness import wait_for


def _served(port: int) -> bytes:
    pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=10)
    return ssl.PEM_cert_to_DER_cert(pem)


def _on_file(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def test_a_renewed_certificate_is_served_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "CERT_RECHECK_S", 0.1)  # the test's patience, not a fake
    first, renewed = make_pki(tmp_path / "first"), make_pki(tmp_path / "renewed")
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(first.cert, live / "cert.pem")
    shutil.copy(first.key, live / "key.pem")
    tls = TlsConfig(str(live / "cert.pem"), str(live / "key.pem"), str(first.ca))

    async def run() -> None:
        server = HttpServer(FastAPI(), "127.0.0.1", 0, tls, RequestLimits())
        port = int((await server.start()).rpartition(":")[2])
        try:
            assert await asyncio.to_thread(_served, port) == _on_file(first.cert)
            # The renewal: key first, then the certificate (as a Secret update lands both).
            shutil.copy(renewed.key, live / "key.pem")
            shutil.copy(renewed.cert, live / "cert.pem")
            os.utime(live / "cert.pem")

            async def renewed_served() -> bool:
                return await asyncio.to_thread(_served, port) == _on_file(renewed.cert)

            await wait_for(renewed_served, 30.0, "the renewed certificate is served")
        finally:
            await server.stop()

    asyncio.run(run())
