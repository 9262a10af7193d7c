"""End to end over real gRPC on loopback: router, prefill and decode as separate processes.

Disaggregated output must be token-for-token what one engine produces, and what HF produces
for greedy decoding.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from app.client import generate, router_channel
from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.integration.cluster_util import generate_many, nothing_held, run, worker_stats
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow

NO_LOCAL_PREFILL = ("--local-prefill-tokens", "0")
TOKEN_PROMPT_LENS = (1, 2, 5, 15, 16, 17, 31, 32, 33, 64, 100, 250)
TEXT_PROMPTS = (
    "The weather today is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Numbers: 1, 2, 3, 4,",
)


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    # Every request disaggregated (no local prefill of short prompts): these tests are about
    # the prefill -> transfer -> decode path.
    config = ClusterConfig(model=str(llama_dir), log_dir=log_dir, router_args=NO_LOCAL_PREFILL)
    with LocalCluster(config) as c:
        yield c


def _prompts() -> list[str | list[int]]:
    rng = random.Random(16)
    token_prompts: list[str | list[int]] = [
        [rng.randrange(1024) for _ in range(n)] for n in TOKEN_PROMPT_LENS
    ]
    return [*token_prompts, *TEXT_PROMPTS]


def _request(
    prompt: str | list[int], sampling: common_pb2.SamplingParams
) -> router_pb2.GenerateRequest:
    if isinstance(prompt, str):
        return router_pb2.GenerateRequest(prompt=prompt, sampling=sampling)
    return router_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)


def test_greedy_matches_one_engine_and_hf(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = _prompts()
    assert len(prompts) == 16
    sampling = common_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = run(generate_many(cluster.address, [_request(p, sampling) for p in prompts]))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = make_llm(llama_dir).generate(prompts, params)  # type: ignore[arg-type]
    hf = load_hf(llama_dir)
    for prompt, result, expected in zip(prompts, results, reference, strict=True):
        assert result.token_ids == expected.token_ids, prompt
        assert result.text == expected.text
        assert result.finish_reason == "length"
        assert result.completion_tokens == 24
        assert result.prompt_tokens == len(expected.prompt_token_ids)
        assert result.token_ids == hf_greedy(hf, expected.prompt_token_ids, 24)
    stats = run(worker_stats(cluster))
    # The decode worker imported every prompt's KV: it computed none of them itself.
    assert stats["decode-0"].num_prompt_tokens_computed == 0
    assert stats["prefill-0"].num_prompt_tokens_computed > 0
    assert run(nothing_held(cluster))


def test_seeded_sampling_matches_one_engine(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = _prompts()
    requests, params = [], []
    for i, prompt in enumerate(prompts):
        sampling = common_pb2.SamplingParams(
            max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, stop=["\n\n"]
        )
        requests.append(_request(prompt, sampling))
        params.append(
            SamplingParams(
                max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, stop=["\n\n"]
            )
        )
    results = run(generate_many(cluster.address, requests))
    reference = make_llm(llama_dir).generate(prompts, params)  # type: ignore[arg-type]
    for result, expected in zip(results, reference, strict=True):
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.finish_reason == expected.finish_reason
    assert run(worker_stats(cluster))["decode-0"].num_prompt_tokens_computed == 0


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({}, "prompt_token_ids"),
        ({"prompt": "hi", "prompt_token_ids": [1, 2]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 600}, "max_model_len"),
        ({"prompt_token_ids": [1, 1024]}, "prompt_token_ids"),
        ({"prompt": "hi", "sampling": {"max_tokens": 0}}, "max_tokens"),
        ({"prompt": "hi", "sampling": {"max_tokens": -1}}, "max_tokens"),
        ({"prompt": "hi", "sampling": {"temperature": -0.1}}, "temperature"),
        ({"prompt": "hi", "sampling": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "hi", "sampling": {"top_p": 1.01}}, "top_p"),
        ({"prompt": "hi", "sampling": {"stop_token_ids": [5000]}}, "stop_token_ids"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    cluster: LocalCluster, request_fields: dict[str, object], field: str
) -> None:
    fields = dict(request_fields)
    sampling = common_pb2.SamplingParams(**fields.pop("sampling", {}))  # type: ignore[arg-type]
    request = router_pb2.GenerateRequest(sampling=sampling, **fields)  # type: ignore[arg-type]

    async def call() -> grpc.aio.AioRpcError:
        async with router_channel(cluster.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(router_pb2_grpc.RouterStub(channel), request)
            return err.value

    error = run(call())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.details() or "")
    assert run(nothing_held(cluster))


def test_client_cancel_frees_blocks_on_both_workers(cluster: LocalCluster) -> None:
    async def scenario() -> None:
        sampling = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        request = router_pb2.GenerateRequest(prompt_token_ids=list(range(1, 90)), sampling=sampling)
        async with router_channel(cluster.address) as channel:
            call = router_pb2_grpc.RouterStub(channel).Generate(request)
            num_chunks = 0
            async for response in call:
                num_chunks += response.HasField("chunk")
                if num_chunks == 5:  # mid-stream: tokens are coming from the decode worker
                    break
            stats = await worker_stats(cluster)
            assert stats["decode-0"].num_running == 1
            call.cancel()
        await wait_for(lambda: nothing_held(cluster), 30.0, "all blocks free after cancel")

    run(scenario())


def test_health_reflection_and_metrics(cluster: LocalCluster) -> None:
    async def check() -> list[str]:
        for component in cluster.components:
            async with grpc.aio.insecure_channel(component.address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="")
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, component.name
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            async for reply in replies:
                return [s.name for s in reply.list_services_response.service]
        return []

    assert "pdserve.v1.Router" in run(check())
    run(generate_many(cluster.address, [_request([1, 2, 3], common_pb2.SamplingParams())]))

    def scrape(name: str) -> str:
        component = next(c for c in cluster.components if c.name == name)
        with urllib.request.urlopen(f"http://{component.metrics_address}/metrics") as reply:
            return str(reply.read().decode())

    router, prefill, decode = scrape("router"), scrape("prefill-0"), scrape("decode-0")
    assert "pdserve_ttft_seconds_count" in router and "pdserve_tpot_seconds_count" in router
    # The load for the autoscaler: arrivals, and finished requests' lengths (the cluster is
    # shared with the module's other tests: at least this request's).
    sample = {
        line.split()[0]: float(line.split()[-1])
        for line in router.splitlines()
        if line.startswith(("pdserve_router_arrivals_total", "pdserve_request_"))
    }
    assert sample["pdserve_router_arrivals_total"] >= 1
    assert sample["pdserve_request_prompt_tokens_count"] >= 1
    assert sample["pdserve_request_prompt_tokens_sum"] >= 3
    assert sample["pdserve_request_output_tokens_count"] >= 1
    assert "pdserve_prompt_tokens_computed 0.0" in decode
    assert "pdserve_kv_transfer_seconds_count" in decode
    for text in (prefill, decode):
        assert "pdserve_kv_blocks_free" in text and "pdserve_queue_depth" in text
    received = [
        line for line in decode.splitlines()
        if line.startswith('pdserve_kv_transfer_bytes_total{direction="received"}')
    ]  # fmt: skip
    assert received and float(received[0].split()[-1]) > 0


def test_generate_cli_prints_json_and_reports_prefix_hits(cluster: LocalCluster) -> None:
    prompt = list(range(200, 240))  # 40 tokens: two full blocks of 16
    sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = run(generate_many(cluster.address, [_request(prompt, sampling)]))[0]
    command = [
        sys.executable, "-m", "app", "generate", "--router", cluster.address,
        "--prompt-token-ids", ",".join(map(str, prompt)), "--max-tokens", "6",
        "--temperature", "0", "--ignore-eos", "--json",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == first.token_ids
    assert result["text"] == first.text
    assert result["finish_reason"] == "length"
    # The second identical prompt reuses the prefill worker's cached blocks.
    assert first.cached_tokens == 0
    assert result["usage"] == {"prompt_tokens": 40, "completion_tokens": 6, "cached_tokens": 32}
    assert result["ttft_s"] > 0


def test_two_prefill_two_decode_32_concurrent_streams(
    llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    rng = random.Random(32)
    prompts = [[rng.randrange(1024) for _ in range(rng.randrange(1, 120))] for _ in range(32)]
    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=2,
        num_decode=2,
        log_dir=tmp_path,
        router_args=NO_LOCAL_PREFILL,
    )
    with LocalCluster(config) as cluster:
        results = run(generate_many(cluster.address, [_request(p, sampling) for p in prompts]))
        stats = run(worker_stats(cluster))
        assert run(nothing_held(cluster))
    reference = make_llm(llama_dir).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    for result, expected in zip(results, reference, strict=True):
        assert result.token_ids == expected.token_ids
    # Both pools shared the load; decode computed no prompt token.
    assert stats["prefill-0"].num_prompt_tokens_computed > 0
    assert stats["prefill-1"].num_prompt_tokens_computed > 0
    assert stats["decode-0"].num_prompt_tokens_computed == 0
    assert stats["decode-1"].num_prompt_tokens_computed == 0
