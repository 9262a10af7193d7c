"""Faults on the OpenAI HTTP path: a decode worker killed (kill -9) mid-stream (the SSE stream
migrates and ends exactly as one engine's output), and a client that stops reading (dropped
after the client idle timeout, every block freed). A client that disconnects:
``tests/openai/test_http_raw.py``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import metric, stats, survivors_hold_nothing
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
IDLE_S = 4.0


@pytest.fixture
def cluster(llama_dir: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_decode=2,
        log_dir=tmp_path,
        router_http_port=0,
        decode_args=("--max-buffered-tokens", "32"),
        router_args=("--local-prefill-tokens", "0", "--client-idle-timeout-s", str(IDLE_S)),
    )
    with LocalCluster(config) as c:
        yield c


def test_a_killed_decode_worker_mid_sse_stream_migrates_exactly(
    cluster: LocalCluster, llama_dir: Path
) -> None:
    prompt = list(range(20, 52))
    body = {
        "prompt": prompt,
        "max_tokens": 300,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }

    async def run() -> list[int]:
        ids: list[int] = []
        async with (
            httpx2.AsyncClient(base_url=cluster.http_url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            killed = False
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                message = json.loads(line[len("data: ") :])
                assert "error" not in message, message
                for choice in message["choices"]:
                    ids.extend(choice["token_ids"])
                if len(ids) >= 20 and not killed:
                    serving = [d for d in cluster.decode if (await stats(d)).num_running]
                    (victim,) = serving
                    os.kill(victim.process.pid, signal.SIGKILL)
                    killed = True
        return ids

    ids = asyncio.run(run())
    (ref,) = LLM(str(llama_dir)).generate(
        [prompt], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    )
    assert ids == ref.token_ids  # greedy on the tiny model: no near-tie in this prompt's run
    assert metric(cluster.router, "pdserve_migrations_total") >= 1


@pytest.fixture
def no_migration(llama_dir: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        log_dir=tmp_path,
        router_http_port=0,
        max_restarts=0,
        router_args=("--local-prefill-tokens", "0", "--migration-limit", "0"),
    )
    with LocalCluster(config) as c:
        yield c


def test_a_failure_after_streaming_began_is_an_error_event(no_migration: LocalCluster) -> None:
    """With migration off, a decode worker killed mid-stream ends the SSE stream with a
    ``data: {"error": ...}`` event (503, no internals) and then ``[DONE]``."""
    body = {"prompt": list(range(20, 40)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    decode = no_migration.decode[0]

    async def run() -> list[str]:
        events: list[str] = []
        async with (
            httpx2.AsyncClient(base_url=no_migration.http_url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 5:
                    os.kill(decode.process.pid, signal.SIGKILL)
        return events

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["type"] == "service_unavailable" and "127.0.0.1" not in error["message"]


def test_a_client_that_stops_reading_is_dropped_and_everything_freed(
    cluster: LocalCluster,
) -> None:
    body = json.dumps(
        {
            "prompt": list(range(7, 15)),
            "max_tokens": 480,
            "temperature": 0.0,
            "ignore_eos": True,
            # ~0.5 KB per token, 48 choices: ~11 MB, far more than the kernel's socket
            # buffers (4 MiB at most here) and asyncio's can hold for a client that reads not.
            "logprobs": 20,
            "n": 48,
            "stream": True,
        }
    ).encode()
    assert cluster.router is not None
    host, port = cluster.router.http_address.rsplit(":", 1)
    before = metric(cluster.router, "pdserve_client_idle_cancels_total")

    async def run() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow client's window
        sock.connect((host, int(port)))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
        sock.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")  # the stream began; now silence
        try:

            async def dropped() -> bool:
                count = metric(cluster.router, "pdserve_client_idle_cancels_total")
                return count == before + 1

            await wait_for(dropped, 60.0 + IDLE_S, "the silent client is dropped", poll_s=0.1)

            async def freed() -> bool:
                return await survivors_hold_nothing(cluster)

            await wait_for(freed, 60.0, "its blocks are freed", poll_s=0.1)
        finally:
            sock.close()

    asyncio.run(run())
