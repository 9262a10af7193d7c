"""The OpenAI API at the HTTP level: SSE framing byte for byte, body limits, keys, a client
that disconnects mid-stream (both workers free its blocks), a flood of silent sockets, and 503
while draining."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from tests.faults.faults_util import metric, survivors_hold_nothing
from tests.openai.conftest import API_KEY, MODEL_NAME
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
AUTH = {"authorization": f"Bearer {API_KEY}"}


def post(cluster: LocalCluster, path: str, body: Any, **kwargs: Any) -> httpx2.Response:
    return httpx2.post(f"{cluster.http_url}{path}", json=body, headers=AUTH, timeout=60, **kwargs)


def events_of(raw: bytes) -> list[bytes]:
    """SSE events, checked for the framing: each is one ``data: `` line and a blank line."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = raw[:-2].split(b"\n\n")
    for e in events:
        assert e.startswith(b"data: ") and b"\n" not in e, e
    return [e[len(b"data: ") :] for e in events]


def test_sse_framing_is_exact(http_cluster: LocalCluster) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": [5, 6, 7],
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{http_cluster.http_url}/v1/completions"
    with httpx2.stream("POST", url, json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        raw = b"".join(response.iter_bytes())
    *chunks, done = events_of(raw)
    assert done == b"[DONE]"
    messages = [json.loads(c) for c in chunks]
    # The bytes are exactly the compact JSON of each message: nothing else on the wire.
    assert (
        raw
        == b"".join(
            b"data: " + json.dumps(m, separators=(",", ":")).encode() + b"\n\n" for m in messages
        )
        + b"data: [DONE]\n\n"
    )
    assert all(m["object"] == "text_completion" for m in messages)
    assert messages[-1]["choices"] == [] and messages[-1]["usage"]["completion_tokens"] == 6
    assert messages[-2]["choices"][0]["finish_reason"] == "length"


def test_limits_keys_health_and_metrics(http_cluster: LocalCluster) -> None:
    base = http_cluster.http_url
    huge = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    declared = httpx2.post(f"{base}/v1/completions", content=huge, headers=AUTH, timeout=60)
    assert declared.status_code == 413
    assert "--max-request-bytes" in declared.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
        for _ in range(6):
            yield b"x" * (1 << 20)

    streamed = httpx2.post(f"{base}/v1/completions", content=chunked(), headers=AUTH, timeout=60)
    assert streamed.status_code == 413
    missing = httpx2.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    not_json = httpx2.post(f"{base}/v1/completions", content=b"{nope", headers=AUTH, timeout=60)
    assert not_json.status_code == 400 and not_json.json()["error"]["param"] == "body"
    assert httpx2.get(f"{base}/health", timeout=60).status_code == 200  # no key needed
    # The public port is outside the metrics NetworkPolicy: /metrics there needs the key.
    assert httpx2.get(f"{base}/metrics", timeout=60).status_code == 401
    scrape = httpx2.get(f"{base}/metrics", headers=AUTH, timeout=60)
    assert scrape.status_code == 200
    assert 'pdserve_http_requests_total{route="/v1/completions",status="413"}' in scrape.text


def test_a_disconnect_mid_stream_frees_both_workers(http_cluster: LocalCluster) -> None:
    router = http_cluster.router
    finished = metric(router, "pdserve_requests_total")
    body = {
        "model": MODEL_NAME,
        "prompt": list(range(10, 40)),
        "max_tokens": 480,  # seconds of decoding: cut off long before the end
        "ignore_eos": True,
        "stream": True,
    }

    async def run() -> None:
        async with (
            httpx2.AsyncClient(base_url=http_cluster.http_url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r,
        ):
            assert r.status_code == 200
            events = (line async for line in r.aiter_lines() if line)
            for _ in range(3):  # a few tokens arrived: both workers have held it
                assert (await anext(events)).startswith("data: ")
        # The connection is closed here, mid-stream.

        async def freed() -> bool:
            return await survivors_hold_nothing(http_cluster)

        await wait_for(freed, 60.0, "both workers freed the disconnected request", poll_s=0.1)

    asyncio.run(run())
    # Freed by the cancellation, not by finishing: no request finished meanwhile.
    assert metric(router, "pdserve_requests_total") == finished


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_gone_before_its_first_byte_frees_everything(
    http_cluster: LocalCluster, stream: bool
) -> None:
    """The client sends its request and hangs up at once: the router notices (before any
    token, or while a whole response is being collected) and cancels on the workers."""
    router = http_cluster.router
    assert router is not None
    finished = metric(router, "pdserve_requests_total")
    body = json.dumps(
        {"prompt": list(range(60, 90)), "max_tokens": 480, "ignore_eos": True, "stream": stream}
    ).encode()
    host, port = router.http_address.rsplit(":", 1)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        sock.shutdown(socket.SHUT_RDWR)  # gone before a byte of the answer

    async def freed() -> bool:
        return await survivors_hold_nothing(http_cluster) and (
            metric(router, "pdserve_router_inflight_requests") == 0
        )

    asyncio.run(wait_for(freed, 60.0, "the abandoned request is freed", poll_s=0.1))
    assert metric(router, "pdserve_requests_total") == finished  # cancelled, not finished


def test_a_flood_of_silent_sockets_closes_while_a_keyed_request_succeeds(
    http_cluster: LocalCluster,
) -> None:
    """Past --max-idle-connections (1024 by default) silent sockets, the oldest are closed at
    once and the rest at --request-header-timeout-s (10 s) from their accept, while a request
    with the API key is served (and one without is still 401). Before, uvicorn held every one
    for ever, and past its connection limit answered 503 to everyone."""
    host, _, port = http_cluster.http_url.removeprefix("http://").rpartition(":")
    silent = [socket.create_connection((host, int(port))) for _ in range(1100)]
    try:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3}
        assert post(http_cluster, "/v1/completions", body).status_code == 200
        unkeyed = httpx2.post(f"{http_cluster.http_url}/v1/completions", json=body, timeout=60)
        assert unkeyed.status_code == 401
        for sock in silent:  # every one closed by the router (a 408, or nothing), then EOF
            sock.settimeout(40)
            reply = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(4096):
                    reply += chunk
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:80]
    finally:
        for sock in silent:
            sock.close()
    assert metric(http_cluster.router, "pdserve_http_idle_evicted_total") >= 1100 - 1024


@pytest.fixture
def templateless(llama_dir: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    """A model without a chat template, colocated (cheap), with one router to drain."""
    model = tmp_path / "no-template"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    cluster_config = ClusterConfig(
        model=str(model),
        num_prefill=0,
        colocated=True,
        router_http_port=0,
        log_dir=tmp_path / "logs",
        max_restarts=0,
    )
    with LocalCluster(cluster_config) as cluster:
        yield cluster


def test_no_template_is_named_and_draining_answers_503(templateless: LocalCluster) -> None:
    base = templateless.http_url
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = httpx2.post(f"{base}/v1/chat/completions", json=chat, timeout=60)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "messages" and "chat_template" in error["message"]
    long = {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "stream": True}
    router = templateless.router
    assert router is not None

    async def run() -> None:
        async with (
            httpx2.AsyncClient(base_url=base, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=long) as r,
        ):
            lines = (line async for line in r.aiter_lines() if line)
            assert (await anext(lines)).startswith("data: ")
            router.process.send_signal(signal.SIGTERM)  # drains: this stream keeps it up

            async def unhealthy() -> bool:
                return (await client.get("/health")).status_code == 503

            await wait_for(unhealthy, 60.0, "health turns 503 on drain", poll_s=0.05)
            during = await client.post("/v1/completions", json={"prompt": "hi"})
            assert during.status_code == 503 and during.headers["retry-after"] == "1"
            assert during.json()["error"]["message"] == "router is draining"
            rest = [line async for line in lines]
            assert rest[-1] == "data: [DONE]"  # the stream in flight finished

    asyncio.run(run())
    assert router.process.wait(timeout=60) == 0
