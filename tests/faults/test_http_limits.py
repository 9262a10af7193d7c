"""Requests that would pin or swamp a router, each refused by name before any work:
- a non-streamed response that could outgrow ``--max-output-bytes`` (many choices x many
  tokens x top logprobs: it is held whole until its last token): 400 naming the flag;
- a body trickled in (``Content-Length`` then a byte now and then): 408 after
  ``--request-body-timeout-s``, instead of a request (and a drain) held for ever;
- ``--max-concurrent-requests`` in flight: the next is 429 with Retry-After (HTTP) and
  RESOURCE_EXHAUSTED (gRPC), both naming the flag;
- a request head (request line + headers) past ``--max-header-bytes``, as one huge header or
  many small ones: 431; one trickled in: 408 after ``--request-header-timeout-s``;
- hundreds of silent connections: each closed within ``--request-header-timeout-s`` of its
  accept, and past ``--max-idle-connections`` the oldest at once, while requests go on being
  served (before, they were held for ever and, past uvicorn's connection limit, every request
  got 503).
Before, each was accepted: the one-huge-request probe started generating, the trickled body
was still open after 90 s, no request was ever refused for load, and a 10 MB header or
100 000 headers were parsed whole."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2
import pytest

from app.client import router_channel
from app.local_cluster import ClusterConfig, LocalCluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.faults.faults_util import metric, stats
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
BODY_TIMEOUT_S = 2
MAX_OUTPUT_BYTES = 1 << 20
MAX_CONCURRENT = 2
MAX_HEADER_BYTES = 16384
HEADER_TIMEOUT_S = 2
MAX_IDLE = 64
SILENT = 400  # past MAX_IDLE, and past uvicorn's limit (MAX_CONCURRENT + 256 connections)


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        router_http_port=0,
        log_dir=tmp_path_factory.mktemp("logs"),
        router_args=(
            "--local-prefill-tokens",
            "0",
            "--max-output-bytes",
            str(MAX_OUTPUT_BYTES),
            "--request-body-timeout-s",
            str(BODY_TIMEOUT_S),
            "--max-concurrent-requests",
            str(MAX_CONCURRENT),
            "--max-header-bytes",
            str(MAX_HEADER_BYTES),
            "--request-header-timeout-s",
            str(HEADER_TIMEOUT_S),
            "--max-idle-connections",
            str(MAX_IDLE),
        ),
    )
    with LocalCluster(config) as c:
        yield c


def test_a_response_that_could_outgrow_the_output_budget_is_refused_before_any_work(
    cluster: LocalCluster,
) -> None:
    computed = asyncio.run(stats(cluster.prefill[0])).num_prompt_tokens_computed
    body = {"prompt": [5, 6, 7], "n": 16, "max_tokens": 1000, "logprobs": 5, "ignore_eos": True}
    r = httpx2.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "--max-output-bytes" in message and "16 choice(s) of up to 1000 tokens" in message
    assert asyncio.run(stats(cluster.prefill[0])).num_prompt_tokens_computed == computed
    # Within the budget (fewer tokens), the same request is served.
    small = {**body, "max_tokens": 4, "n": 2}
    assert httpx2.post(f"{cluster.http_url}/v1/completions", json=small, timeout=60).is_success


def test_a_trickled_body_is_refused_after_the_body_timeout(cluster: LocalCluster) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 100\r\n\r\n"
    )
    start = time.monotonic()
    # A byte each 0.5 s, for far longer than the timeout.
    reply = _exchange(cluster, [head.encode()] + [b" "] * 60, gap_s=0.5)
    elapsed = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--request-body-timeout-s" in reply
    assert BODY_TIMEOUT_S <= elapsed < 25  # refused at the timeout, not at the client's end


def _exchange(cluster: LocalCluster, pieces: list[bytes], gap_s: float = 0.0) -> bytes:
    """Sends ``pieces`` (``gap_s`` apart, stopping once the router answers or closes), reads
    the whole reply, then checks the router has closed the connection: one more byte, as a
    client that goes on trickling sends, must not keep it open (before, after a 408 for the
    body, each such byte cancelled uvicorn's keep-alive timer and it stayed open for ever)."""
    host, _, port = cluster.http_url.removeprefix("http://").rpartition(":")
    reply = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.settimeout(gap_s or None)
        for piece in pieces:
            try:
                sock.sendall(piece)
                if gap_s:
                    reply += sock.recv(4096)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if reply:
                break
        sock.settimeout(30)
        while not _whole_response(reply) and (more := sock.recv(4096)):
            reply += more
        with contextlib.suppress(OSError):
            sock.sendall(b" ")
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(4096) == b"", "the router kept the connection open"
    return reply


def _until_closed(sock: socket.socket) -> bytes:
    """What the router sends before it closes ``sock`` (TimeoutError: it never closed it)."""
    reply = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            reply += chunk
    return reply


def _whole_response(reply: bytes) -> bool:
    head, sep, body = reply.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    return bool(sep and length and len(body) >= int(length.group(1)))


def test_request_heads_too_large_or_too_slow_are_refused_before_anything_runs(
    cluster: LocalCluster,
) -> None:
    refused = metric(cluster.router, "pdserve_http_head_refused_total")
    start = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    huge = _exchange(cluster, [start + b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 4096) + b"\r\n"])
    assert huge.startswith(b"HTTP/1.1 431") and b"--max-header-bytes" in huge, huge[:200]
    many = b"".join(b"X-%05d: a\r\n" % i for i in range(2000))  # 24 KB of small headers
    assert _exchange(cluster, [start + many]).startswith(b"HTTP/1.1 431")
    began = time.monotonic()
    slow = _exchange(cluster, [start] + [b"X"] * 60, gap_s=0.5)  # a byte each 0.5 s
    elapsed = time.monotonic() - began
    assert slow.startswith(b"HTTP/1.1 408") and b"--request-header-timeout-s" in slow, slow[:200]
    assert HEADER_TIMEOUT_S <= elapsed < 25  # at the timeout, not when the client gave up
    # Within the bounds, on one keep-alive connection, requests go on being served.
    fine = start + b"X-Pad: " + b"a" * 8192 + b"\r\n\r\n"
    host, _, port = cluster.http_url.removeprefix("http://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for _ in range(3):
            sock.sendall(fine)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert metric(cluster.router, "pdserve_http_head_refused_total") == refused + 3


def test_silent_connections_are_closed_while_requests_are_served(cluster: LocalCluster) -> None:
    host, _, port = cluster.http_url.removeprefix("http://").rpartition(":")
    evicted = metric(cluster.router, "pdserve_http_idle_evicted_total")
    opened = time.monotonic()
    silent = [socket.create_connection((host, int(port)), timeout=30) for _ in range(SILENT)]
    try:
        # While they are open: health, and a request, answered.
        assert httpx2.get(f"{cluster.http_url}/health", timeout=30).status_code == 200
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        r = httpx2.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        for sock in silent:  # every one closed by the router (a 408 or none, then EOF)
            sock.settimeout(HEADER_TIMEOUT_S + 30)
            reply = _until_closed(sock)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:100]
        assert time.monotonic() - opened < HEADER_TIMEOUT_S + 30
        assert metric(cluster.router, "pdserve_http_idle_evicted_total") >= evicted + (
            SILENT - MAX_IDLE
        )
    finally:
        for sock in silent:
            sock.close()


def test_requests_past_the_concurrency_limit_are_refused_for_load(cluster: LocalCluster) -> None:
    long = {"prompt": [9, 10, 11], "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def run() -> None:
        async with httpx2.AsyncClient(base_url=cluster.http_url, timeout=120) as client:
            streams = [client.stream("POST", "/v1/completions", json=long) for _ in range(2)]
            opened = [await s.__aenter__() for s in streams]
            try:
                assert all(r.status_code == 200 for r in opened)

                async def full() -> bool:
                    inflight = metric(cluster.router, "pdserve_router_inflight_requests")
                    return inflight == MAX_CONCURRENT

                await wait_for(full, 60.0, "both streams in flight")
                refused = await client.post(
                    "/v1/completions", json={"prompt": [5], "max_tokens": 2}
                )
                assert refused.status_code == 429 and "retry-after" in refused.headers
                assert "--max-concurrent-requests" in refused.json()["error"]["message"]
                async with router_channel(cluster.address) as channel:
                    request = router_pb2.GenerateRequest(
                        prompt_token_ids=[5], sampling=common_pb2.SamplingParams(max_tokens=2)
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in router_pb2_grpc.RouterStub(channel).Generate(request):
                            pass
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-concurrent-requests" in (err.value.details() or "")
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)

        async def drained() -> bool:
            return metric(cluster.router, "pdserve_router_inflight_requests") == 0

        await wait_for(drained, 60.0, "the streams ended")
        served = await client_post(cluster, {"prompt": [5], "max_tokens": 2})
        assert served == 200  # room again

    asyncio.run(run())


async def client_post(cluster: LocalCluster, body: dict[str, object]) -> int:
    async with httpx2.AsyncClient(base_url=cluster.http_url, timeout=60) as client:
        return (await client.post("/v1/completions", json=body)).status_code
