"""A router rollout as Kubernetes does it: two router replicas behind one Service address, a
client on one persistent channel, and the replica it is connected to terminated (taken out of
the endpoints, then SIGTERM). The client's next calls must reach the other replica at once
(GOAWAY at drain start), not be refused by the draining one until its drain ends, and the
stream in flight on the old replica must finish."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from app.client import router_channel
from app.local_cluster import ClusterConfig, LocalCluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow


class ServiceAddress:
    """What a Service's virtual IP does: each new TCP connection goes to a ready endpoint;
    bytes of an open connection keep going where they went."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.connections: list[str] = []  # the endpoint of each connection, in order
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoint = self.endpoints[0]
        self.connections.append(endpoint)
        host, _, port = endpoint.rpartition(":")
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()


async def _not_serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError:
            return True  # no longer listening: past drain start too
        return bool(reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)


def _second_router(cluster: LocalCluster, log: Path) -> tuple[subprocess.Popen[str], str]:
    cfg = cluster.config
    assert cfg.redis_url
    command = [sys.executable, "-m", "app", "router", "--model", cfg.model]
    command += ["--port", "0", "--redis", cfg.redis_url, "--redis-namespace", cfg.redis_namespace]
    command += ["--drain-timeout-s", "120", "--local-prefill-tokens", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    assert process.stdout is not None
    for line in process.stdout:
        words = line.split()
        if words[:1] == ["pdserve"] and words[2:3] == ["ready"]:
            return process, words[3]
    raise AssertionError(f"the second router exited with {process.wait()}")


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        router_args=("--drain-timeout-s", "120", "--local-prefill-tokens", "0"),
        max_restarts=0,
    )
    with LocalCluster(config) as c:
        yield c


def test_a_draining_router_sends_its_persistent_clients_to_the_other_replica(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    old = cluster.router
    assert old is not None
    new_process, new_address = _second_router(cluster, tmp_path / "router-b.log")
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    short = router_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling)
    long_sampling = common_pb2.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    long = router_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=long_sampling)

    async def scenario() -> None:
        service = ServiceAddress([old.address])
        await service.start()
        channel = router_channel(service.address)
        stub = router_pb2_grpc.RouterStub(channel)
        try:
            first = [r async for r in stub.Generate(short, timeout=120)]
            assert first[-1].HasField("final")
            in_flight = stub.Generate(long, timeout=300)
            tokens: list[int] = []
            async for response in in_flight:  # until the long stream runs on the old replica
                tokens.extend(response.chunk.token_ids)
                break
            # Termination: out of the endpoints first (what a preStop waits for), then SIGTERM.
            service.endpoints[:] = [new_address]
            old.process.send_signal(signal.SIGTERM)

            await wait_for(lambda: _not_serving(old.address), 60.0, "the old replica drains")

            # A call sent while the GOAWAY is on the wire is cancelled by the draining server:
            # gRPC's own race (grpc/grpc#19969), which no server can close. The promise is
            # about the calls after the client has the GOAWAY: its channel is then not READY.
            async def goaway_received() -> bool:
                return channel.get_state() != grpc.ChannelConnectivity.READY

            await wait_for(goaway_received, 60.0, "the client has the old replica's GOAWAY")
            # The next calls on the same channel: served (by the other replica), none refused.
            for _ in range(3):
                replies = [r async for r in stub.Generate(short, timeout=120)]
                assert replies[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert service.connections[-1] == new_address
            async for response in in_flight:  # the old replica finishes what it had
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
            assert len(tokens) == 300
        except grpc.aio.AioRpcError as exc:
            raise AssertionError(f"a call was refused during the rollout: {exc}") from exc
        finally:
            await channel.close()
            await service.close()

    try:
        asyncio.run(scenario())
        assert old.process.wait(timeout=60) == 0
    finally:
        new_process.send_signal(signal.SIGTERM)
        try:
            new_process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            new_process.kill()
