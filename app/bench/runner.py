"""Drives load at a router, through its gRPC API or its OpenAI HTTP API, and timestamps
every streamed chunk at the client.

Open loop (``rate``): arrivals are a Poisson process, exponential gaps from a seeded RNG, sent
whether or not earlier requests finished. Closed loop (``concurrency``): that many clients, each
sending its next request when the last one ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc

from app.bench.stats import RequestRecord
from app.bench.workload import BenchRequest, poisson_arrivals
from app.client import api_key_metadata, router_channel
from app.openai_client import ApiError, http_client, stream
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass(frozen=True)
class LoadConfig:
    router: str | None = None  # gRPC host:port
    http: str | None = None  # the OpenAI API's base URL, http://host:port (no /v1)
    rate: float | None = None  # requests per second (open loop)
    concurrency: int | None = None  # clients (closed loop)
    seed: int = 0
    request_timeout_s: float = 600.0
    api_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.router is None) == (self.http is None):
            raise ValueError("pass exactly one of --router and --http")
        if self.http is not None and self.http.rstrip("/").endswith("/v1"):
            raise ValueError(f"--http is the server's base URL, without /v1: {self.http}")
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("pass exactly one of --rate and --concurrency")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")


def to_proto(request: BenchRequest) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=request.output_len, temperature=0.0, ignore_eos=True
    )
    if request.prompt is not None:
        return router_pb2.GenerateRequest(prompt=request.prompt, sampling=sampling)
    return router_pb2.GenerateRequest(
        prompt_token_ids=list(request.prompt_token_ids), sampling=sampling
    )


def to_completion(request: BenchRequest) -> dict[str, Any]:
    """The same request as an OpenAI text completion (vLLM's extras: ignore_eos, and
    return_token_ids so tokens are counted exactly, not per chunk)."""
    prompt: str | list[int] = (
        request.prompt if request.prompt is not None else list(request.prompt_token_ids)
    )
    return {
        "prompt": prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


# Sends request i, filling its record (times relative to ``start``).
Send = Callable[[BenchRequest, RequestRecord, float], Awaitable[None]]


@contextlib.asynccontextmanager
async def _grpc(config: LoadConfig) -> AsyncIterator[Send]:
    assert config.router is not None
    clock = time.perf_counter
    async with router_channel(config.router, config.tls_ca, config.tls_server_name) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def send(request: BenchRequest, record: RequestRecord, start: float) -> None:
            try:
                stream = stub.Generate(
                    to_proto(request),
                    timeout=config.request_timeout_s,
                    metadata=api_key_metadata(config.api_key),
                )
                async for response in stream:
                    if response.HasField("chunk"):
                        if response.chunk.token_ids:
                            record.chunk_times_s.append(clock() - start)
                            record.num_output_tokens += len(response.chunk.token_ids)
                    else:  # token counts and the router's phases; other times are ours
                        record.num_prompt_tokens = response.final.usage.prompt_tokens
                        record.phases_s = dict(response.final.timings.phases)
            except grpc.aio.AioRpcError as exc:
                record.error = f"{exc.code().name}: {exc.details()}"

        yield send


@contextlib.asynccontextmanager
async def _http(config: LoadConfig) -> AsyncIterator[Send]:
    assert config.http is not None
    clock = time.perf_counter
    async with http_client(config.http, config.request_timeout_s, config.tls_ca) as client:

        async def send(request: BenchRequest, record: RequestRecord, start: float) -> None:
            try:
                result = await stream(
                    client,
                    "/v1/completions",
                    to_completion(request),
                    config.api_key,
                    clock=lambda: clock() - start,
                    server_hostname=config.tls_server_name,
                )
            except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
                record.error = str(exc) or type(exc).__name__
                return
            record.chunk_times_s = result.chunk_times_s
            record.num_output_tokens = sum(result.num_chunk_tokens)
            record.num_prompt_tokens = int(result.usage.get("prompt_tokens", 0))
            timings = result.usage.get("timings") or [{}]
            record.phases_s = dict(timings[0].get("phases_s") or {})

        yield send


async def run_load(
    config: LoadConfig,
    requests: list[BenchRequest],
    on_done: Callable[[int, int], None] = lambda done, total: None,
) -> tuple[list[RequestRecord], float]:
    """Every request's record (send time relative to the start) and the run's duration."""
    clock = time.perf_counter
    records = [RequestRecord(i, r.num_prompt_tokens, 0.0) for i, r in enumerate(requests)]
    finished = 0
    frontend = _grpc(config) if config.router is not None else _http(config)
    async with frontend as send:
        start = clock()

        async def one(i: int) -> None:
            nonlocal finished
            records[i].send_s = clock() - start
            await send(requests[i], records[i], start)
            finished += 1
            on_done(finished, len(requests))

        if config.rate is not None:
            tasks = []
            arrivals_s = poisson_arrivals(len(requests), config.rate, config.seed)
            for i, arrival_s in enumerate(arrivals_s):
                await asyncio.sleep(max(0.0, arrival_s - (clock() - start)))
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        else:
            assert config.concurrency is not None
            pending = iter(range(len(requests)))

            async def client() -> None:
                for i in pending:  # one shared iterator: each index is taken once
                    await one(i)

            await asyncio.gather(*(client() for _ in range(config.concurrency)))
        duration_s = clock() - start
    return records, duration_s
