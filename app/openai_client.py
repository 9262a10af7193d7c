"""A small streaming client of the router's OpenAI API (``pdserve demo``, ``pdserve bench
--http``): one POST, Server-Sent Events read as they arrive, each timestamped on the client.

aiohttp, as ``vllm bench serve`` uses: a client's own overhead is part of every TTFT it
measures, and httpx's (1-2 ms per request here) would be charged to the server. The tests use
the official ``openai`` client.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class ApiError(Exception):
    """The server's error (an HTTP status, or an error event mid-stream)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class StreamResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    chunk_times_s: list[float] = field(default_factory=list)  # one per chunk that had tokens
    num_chunk_tokens: list[int] = field(default_factory=list)


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


async def stream(
    session: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    api_key: str | None = None,
    on_text: Callable[[str], None] = lambda text: None,
    clock: Callable[[], float] = time.perf_counter,
    server_hostname: str | None = None,
) -> StreamResult:
    """POSTs ``body`` (``stream: true`` is set) to ``path`` (``/v1/chat/completions`` or
    ``/v1/completions``). A chunk's tokens are counted from ``token_ids`` when the body asks
    for ``return_token_ids``, else one per chunk with text. ``server_hostname``: the name to
    verify in an https router's certificate (a port-forward). Raises ``ApiError`` (and
    ``aiohttp.ClientError`` when the connection fails)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    result = StreamResult()
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    post = session.post(path, json=payload, headers=headers, server_hostname=server_hostname)
    async with post as response:
        if response.status != 200:
            raise ApiError(response.status, _error_message(await response.read()))
        async for raw in response.content:  # one line at a time
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :]
            if data == b"[DONE]":
                break
            message = json.loads(data)
            if "error" in message:
                raise ApiError(200, str(message["error"].get("message")))
            if message.get("usage"):
                result.usage = message["usage"]
            for choice in message.get("choices", []):
                _add(result, choice, on_text, clock)
    return result


def _add(
    result: StreamResult,
    choice: dict[str, Any],
    on_text: Callable[[str], None],
    clock: Callable[[], float],
) -> None:
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    ids = choice.get("token_ids")
    num_tokens = len(ids) if ids is not None else int(bool(text))
    if num_tokens:
        result.chunk_times_s.append(clock())
        result.num_chunk_tokens.append(num_tokens)
    if ids:
        result.token_ids.extend(ids)
    if text:
        result.text += text
        on_text(text)
    if choice.get("finish_reason"):
        result.finish_reason = choice["finish_reason"]


def http_client(
    base_url: str, timeout_s: float, tls_ca: str | None = None
) -> aiohttp.ClientSession:
    """A session for ``base_url`` (``http://host:port``, no ``/v1``); ``tls_ca`` verifies an
    https router. No connection limit: a load generator's concurrency is its own."""
    context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    connector = aiohttp.TCPConnector(limit=0, ssl=context if context is not None else True)
    return aiohttp.ClientSession(
        base_url=base_url,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=connector,
        trust_env=False,
    )
