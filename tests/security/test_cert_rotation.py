"""Client certificates rotate without a restart: once the files change, a ``ChannelPool``
presents the new certificate on new calls (servers already reload theirs on change), and the
router's workers follow it."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from native_engine.builder import build_native_engine
from pdserve.common.channels import ChannelPool
from pdserve.common.server import ServerConfig, ServiceServer
from pdserve.common.tls import TlsConfig
from pdserve.v1 import common_pb2
from prefill_service.config import PrefillConfig
from prefill_service.service import PrefillService
from router.worker_pool import WorkerPool
from tests.security.tls_util import make_pki
from tests.services.harness import engine_config


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


def test_router_worker_stubs_follow_the_pool_across_a_renewal(
    tmp_path: Path, llama_dir: Path
) -> None:
    """The router's workers call through the pool's current channel: once a renewal retires
    the channels (any call may notice it: a new worker joining, a lease release) and their
    grace is over, a worker's next call still works, on a new channel."""
    pki = make_pki(tmp_path / "pki")
    tls = TlsConfig(str(pki.cert), str(pki.key), str(pki.ca))

    async def run() -> None:
        config = PrefillConfig(engine=engine_config(llama_dir), server=ServerConfig(tls=tls))
        server = ServiceServer(PrefillService(config, build_native_engine), config.server)
        await server.start()
        await server.ready()
        pool = WorkerPool(prefill=(server.address,), tls=tls)
        pool.channels.recheck_s = pool.channels.retired_grace_s = 0.0
        worker = pool.prefill[server.address]
        layout = (await worker.prefill_stub.GetStats(common_pb2.GetStatsRequest())).layout
        expected = (layout.model_fingerprint, layout.block_size)  # the router's, as it matches
        try:
            await worker.refresh(*expected)
            assert worker.healthy
            later_ns = os.stat(pki.cert).st_mtime_ns + 1_000_000_000
            os.utime(pki.cert, ns=(later_ns, later_ns))
            pool.channels.get("127.0.0.1:1")  # notices the renewal: every channel retired
            await asyncio.gather(*pool.channels._retired.values())  # and closed (no grace)
            await worker.refresh(*expected)
            assert worker.healthy, "the worker's stats call failed after the renewal"
        finally:
            await pool.close()
            await server.shutdown()

    asyncio.run(run())


def test_a_renewal_does_not_cut_a_long_call_on_the_retired_channel(tmp_path: Path) -> None:
    """A relay (here a health Watch stream) open when the files change keeps its channel past
    the retirement's grace, until it ends; then the channel closes. Before, the channel was
    closed at the grace, cutting every generation older than it (and re-prefilling it)."""
    pki = make_pki(tmp_path / "pki")
    tls = TlsConfig(str(pki.cert), str(pki.key), str(pki.ca))

    async def run() -> None:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_secure_port(
            "127.0.0.1:0", tls.server_credentials(require_client_auth=True)
        )
        await server.start()
        address = f"127.0.0.1:{port}"
        pool = ChannelPool(tls=tls, recheck_s=0.0, retired_grace_s=0.1)
        try:
            channel = pool.get(address)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            pool.track(channel, watch)
            await watch.read()  # the stream is up
            later_ns = os.stat(pki.cert).st_mtime_ns + 1_000_000_000
            os.utime(pki.cert, ns=(later_ns, later_ns))
            assert pool.get(address) is not channel  # retired
            closing = pool._retired[channel]
            await asyncio.sleep(0.5)  # well past the grace
            assert not closing.done() and not watch.done()
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            update = await watch.read()  # the old channel still carries the stream
            assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            await asyncio.wait_for(closing, 10)  # once it ended, the channel goes
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(run())
