"""``pdserve up``'s embedded Redis on a shared host, and killed under a running cluster.

It must not be a way in (no TCP port, a socket only this user can reach, a password, no
``CONFIG``/``MODULE``), must not show its password (argv, the ready line), and a kill -9 of it
must not make the cluster's later worker crashes permanent: it is started again and the
workers register again by themselves."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from pathlib import Path

import psutil
import pytest
import redis
from redis.exceptions import AuthenticationError, ResponseError

from app.embedded_redis import DISABLED_COMMANDS, EmbeddedRedis, redacted
from pdserve.cluster.registry import Registry
from pdserve.v1 import common_pb2, router_pb2
from tests.integration.cluster_util import generate_many, start_up
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow


def _url_of(server: psutil.Process) -> str:
    """What a client of this user reads from the server's own config file (no one else can).
    redis-server retitles itself ``redis-server unixsocket:<path>``; the file is beside it."""
    socket_path = server.cmdline()[-1].partition("unixsocket:")[2]
    conf = Path(socket_path).parent / "redis.conf"
    settings = dict(line.split(" ", 1) for line in conf.read_text().splitlines())
    return f"unix://:{settings['requirepass']}@{settings['unixsocket']}?db=0"


def _redis_server(up: psutil.Process) -> psutil.Process:
    servers = [p for p in up.children() if "redis-server" in p.name()]
    assert len(servers) == 1, servers
    return servers[0]


def test_embedded_redis_takes_only_its_users_authenticated_clients() -> None:
    with EmbeddedRedis() as server:
        process = psutil.Process(server.pid)
        assert not process.net_connections(kind="inet")  # no TCP port at all
        directory = os.path.dirname(server.socket_path)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert server.password not in " ".join(process.cmdline())
        assert server.password not in redacted(server.url)
        stranger = redis.Redis(unix_socket_path=server.socket_path)
        with pytest.raises(AuthenticationError):
            stranger.set("k", "v")
        stranger.close()
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        for command in DISABLED_COMMANDS:
            with pytest.raises(ResponseError, match="unknown command"):
                client.execute_command(command, "HELP")
        with pytest.raises(ResponseError, match="unknown command"):
            client.config_set("dir", "/tmp")  # CONFIG SET dir + SAVE: files written as us
        client.close()


def test_up_restarts_a_killed_embedded_redis_and_workers_register_again(
    llama_dir: Path,
) -> None:
    process, address = start_up("--model", str(llama_dir), "--port", "0", "--decode", "2")
    try:
        up = psutil.Process(process.pid)
        first = _redis_server(up)
        url = _url_of(first)
        password = url.split(":")[2].split("@")[0]
        assert password not in " ".join(first.cmdline())
        sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        request = router_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling)

        async def scenario() -> None:
            before = {r.worker_id for r in await Registry.workers_at(url)}
            assert len(before) == 3  # one prefill, two decode workers
            first.send_signal(signal.SIGKILL)

            async def back() -> bool:
                servers = [p for p in up.children() if "redis-server" in p.name()]
                return bool(servers) and servers[0].pid != first.pid

            await wait_for(back, 60.0, "pdserve up started redis-server again")

            async def registered() -> bool:
                try:
                    return {r.worker_id for r in await Registry.workers_at(url)} == before
                except (redis.exceptions.RedisError, OSError):
                    return False  # still starting

            # Same socket, same password; the workers' heartbeats fill the empty registry.
            await wait_for(registered, 60.0, "every worker registered again")
            results = await generate_many(address, [request])
            assert len(results[0].token_ids) == 8

        asyncio.run(scenario())
        assert process.stdout is not None
        process.send_signal(signal.SIGTERM)
        rest = process.stdout.read()
        assert password not in rest
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
