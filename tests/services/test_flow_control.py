"""Flow control on a real cluster (router and a colocated worker, real processes; docs/slo.md):
the router keeps one prompt in flight at a time (``--inflight-tokens-per-worker 1``), so the
rest wait in its queues, where the classes' priorities and the tenants' turns order them.

- A high-priority request sent while low-priority ones wait gets its first token before them.
- A tenant sending a few requests while another floods is served in turns, not after the flood.
- A class whose queue is full sheds with 429 and Retry-After (the OpenAI API); a request whose
  TTFT target cannot be met is refused at once (gRPC: RESOURCE_EXHAUSTED, ``retry-after``),
  never reaching a worker.
- Invalid priorities, classes and targets are refused by name, on both frontends.
- Every output served through the queues is the engine's own (greedy, ``engine.LLM``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx2
import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.faults.faults_util import metric
from tests.services.harness import wait_for

CLASSES = "interactive:priority=-1;batch:priority=5;bulk:priority=9,max_queued=2"
MAX_TOKENS = 4
SAMPLING = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=0,
        colocated=True,
        router_http_port=0,
        log_dir=tmp_path_factory.mktemp("flow-logs"),
        router_args=(
            "--request-classes",
            CLASSES,
            "--inflight-tokens-per-worker",
            "1",
            "--quantum-tokens",
            "1",
            "--fairness-header",
            "x-tenant",
        ),
    )
    with LocalCluster(config) as running:
        yield running


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(48)] for _ in range(n)]


class FirstTokens:
    """The order in which requests' first tokens reach the client."""

    def __init__(self) -> None:
        self.order: list[str] = []

    async def run(
        self,
        stub: router_pb2_grpc.RouterStub,
        name: str,
        request: router_pb2.GenerateRequest,
        tenant: str,
    ) -> list[int]:
        tokens: list[int] = []
        async for response in stub.Generate(request, metadata=(("x-tenant", tenant),)):
            if response.HasField("chunk") and response.chunk.token_ids:
                if not tokens:
                    self.order.append(name)
                tokens.extend(response.chunk.token_ids)
        return tokens


async def _queued(cluster: LocalCluster, name: str, at_least: int) -> None:
    async def enough() -> bool:
        found = await asyncio.to_thread(
            metric, cluster.router, "pdserve_flow_queued_requests", f'class="{name}"'
        )
        return found >= at_least

    await wait_for(enough, 120.0, f"{at_least} {name} requests waiting in the router")


def _batch(prompt: list[int]) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling=SAMPLING, service_class="batch"
    )


def _reference(make_llm: Callable[..., LLM], llama_dir: Path, prompts: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in make_llm(llama_dir).generate(prompts, params)]


def test_a_high_priority_request_overtakes_waiting_low_priority_ones(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    low, high = _prompts(24, 1), _prompts(1, 2)[0]
    reference = _reference(make_llm, llama_dir, [*low, high])

    async def run() -> None:
        tokens = FirstTokens()
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            def asked(prompt: list[int], service_class: str) -> router_pb2.GenerateRequest:
                return router_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling=SAMPLING, service_class=service_class
                )

            lows = [
                asyncio.create_task(tokens.run(stub, f"low{i}", asked(p, "batch"), "a"))
                for i, p in enumerate(low)
            ]
            await _queued(cluster, "batch", 12)
            served_high = await tokens.run(stub, "high", asked(high, "interactive"), "b")
            served_low = await asyncio.gather(*lows)
        after = len(tokens.order) - 1 - tokens.order.index("high")
        print(f"\nfirst tokens after the high-priority request's: {after} of 24 low")
        assert after >= 6, tokens.order
        assert [*served_low, served_high] == reference

    asyncio.run(run())


def test_a_modest_tenant_is_served_in_turns_with_a_flooding_one(cluster: LocalCluster) -> None:
    flood, modest = _prompts(24, 3), _prompts(3, 4)

    async def run() -> None:
        tokens = FirstTokens()
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            floods = [
                asyncio.create_task(tokens.run(stub, f"a{i}", _batch(p), "flood"))
                for i, p in enumerate(flood)
            ]
            await _queued(cluster, "batch", 12)
            await asyncio.gather(
                *(tokens.run(stub, f"b{i}", _batch(p), "modest") for i, p in enumerate(modest)),
                *floods,
            )
        last_modest = max(tokens.order.index(f"b{i}") for i in range(3))
        flood_after = sum(1 for name in tokens.order[last_modest:] if name.startswith("a"))
        print(f"\nflood requests served after the modest tenant's last: {flood_after} of 24")
        assert flood_after >= 6, tokens.order

    asyncio.run(run())


def test_a_full_class_sheds_with_retry_after_and_an_unreachable_target_is_refused_at_once(
    cluster: LocalCluster,
) -> None:
    prompts = _prompts(12, 5)

    async def run() -> None:
        async with httpx2.AsyncClient(base_url=cluster.http_url, timeout=120) as client:

            async def one(prompt: list[int]) -> httpx2.Response:
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "service_tier": "bulk"}
                return await client.post("/v1/completions", json=body)

            answers = await asyncio.gather(*(one(p) for p in prompts))
        shed = [a for a in answers if a.status_code == 429]
        served = [a for a in answers if a.status_code == 200]
        print(f"\nbulk class (max_queued 2), 12 at once: {len(served)} served, {len(shed)} shed")
        assert len(shed) + len(served) == len(answers) and shed and len(served) >= 3
        for answer in shed:
            assert int(answer.headers["retry-after"]) >= 1
            assert "class 'bulk' has 2 requests waiting" in answer.json()["error"]["message"]
        assert metric(cluster.router, "pdserve_flow_shed_total", 'reason="queue_full"') >= 1

        # Under load (more urgent requests one at a time in flight, the rest waiting in the
        # router, ahead of the default class), a request whose target its prediction misses
        # is refused at once, never admitted. The work ahead must be the router's own queue:
        # a worker's reported backlog can read 0 between two of its steps, and a request
        # with nothing ahead is admitted whatever its target (there is nothing to wait for).
        shed = 'reason="slo_unreachable"'
        before = metric(cluster.router, "pdserve_flow_shed_total", shed)
        admitted = metric(cluster.router, "pdserve_flow_admitted_total", 'class="default"')
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            urgent = [
                router_pb2.GenerateRequest(
                    prompt_token_ids=p, sampling=SAMPLING, service_class="interactive"
                )
                for p in _prompts(12, 6)
            ]
            load = [
                asyncio.create_task(FirstTokens().run(stub, f"l{i}", r, "load"))
                for i, r in enumerate(urgent)
            ]
            await _queued(cluster, "interactive", 8)
            request = router_pb2.GenerateRequest(
                prompt_token_ids=prompts[0],
                sampling=SAMPLING,
                slo=router_pb2.SloTargets(ttft_s=0.001),
            )
            start = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(request):
                    pass
            elapsed = time.perf_counter() - start
            await asyncio.gather(*load)
        print(f"an unreachable TTFT target refused in {elapsed * 1000:.1f} ms")
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "misses its target 0.001 s" in (refused.value.details() or "")
        trailers = dict(refused.value.trailing_metadata() or ())
        assert int(trailers["retry-after"]) >= 1
        assert metric(cluster.router, "pdserve_flow_shed_total", shed) == before + 1
        after = metric(cluster.router, "pdserve_flow_admitted_total", 'class="default"')
        assert after == admitted  # refused at admission: it never waited, never reached a worker
        assert elapsed < 5.0  # at once: a request that waited would take its TTL (600 s)

    asyncio.run(run())


def test_invalid_flow_fields_are_refused_by_name(cluster: LocalCluster) -> None:
    url = f"{cluster.http_url}/v1/completions"
    for extra, param, words in (
        ({"priority": "high"}, "priority", "priority"),
        (
            {"priority": 2**31},
            "priority",
            "priority must be an integer in [-2147483648, 2147483647]",
        ),
        ({"service_tier": "gold"}, "service_tier", "'gold' is not a request class"),
        ({"slo": {"ttft_s": -1}}, "slo.ttft_s", "slo.ttft_s must be in (0, 3600]"),
    ):
        body = {"prompt": "hello", "max_tokens": 2, **extra}
        answer = httpx2.post(url, json=body, timeout=60)
        assert answer.status_code == 400, (extra, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"], error

    async def grpc_refusal() -> None:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            request = router_pb2.GenerateRequest(
                prompt="hello", sampling=SAMPLING, service_class="gold"
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in router_pb2_grpc.RouterStub(channel).Generate(request):
                    pass
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "'gold' is not a request class of this router" in (refused.value.details() or "")

    asyncio.run(grpc_refusal())
