"""Client certificates rotate without a restart: once the files change, a ``ChannelPool``
presents the new certificate on new calls (servers already reload theirs on change)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.common.channels import ChannelPool
from pdserve.common.tls import TlsConfig
from tests.security.tls_util import make_pki


async def _check(pool: ChannelPool, address: str) -> grpc.StatusCode:
    stub = health_pb2_grpc.HealthStub(pool.get(address))
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_pool_presents_the_renewed_client_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    client_dir = tmp_path / "client"
    client_dir.mkdir()
    cert, key = client_dir / "cert.pem", client_dir / "key.pem"
    # The client starts with a certificate the server does not accept (another CA's).
    shutil.copy(pki.rogue_cert, cert)
    shutil.copy(pki.rogue_key, key)
    server_tls = TlsConfig(str(pki.cert), str(pki.key), str(pki.ca))
    client_tls = TlsConfig(str(cert), str(key), str(pki.ca))

    async def run() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port(
            "127.0.0.1:0", server_tls.server_credentials(require_client_auth=True)
        )
        await server.start()
        address = f"127.0.0.1:{port}"
        pool = ChannelPool(tls=client_tls, recheck_s=0.0)
        try:
            assert await _check(pool, address) == grpc.StatusCode.UNAVAILABLE
            first = pool.get(address)
            # The renewal: new files in place, a later modification time.
            shutil.copy(pki.cert, cert)
            shutil.copy(pki.key, key)
            later_ns = os.stat(cert).st_mtime_ns + 1_000_000_000
            os.utime(cert, ns=(later_ns, later_ns))
            assert await _check(pool, address) == grpc.StatusCode.OK
            assert pool.get(address) is not first
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(run())


def test_unchanged_files_keep_the_channel(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    tls = TlsConfig(str(pki.cert), str(pki.key), str(pki.ca))

    async def run() -> None:
        pool = ChannelPool(tls=tls, recheck_s=0.0)
        first = pool.get("127.0.0.1:1")
        assert pool.get("127.0.0.1:1") is first
        await pool.close()

    asyncio.run(run())
