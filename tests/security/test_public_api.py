"""The router's public API under hostile input: API keys, size limits checked before any work,
tokenization that never stalls the event loop, named refusals for invalid UTF-8 and oversized
fields, and no key ever in a log."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from app.local_cluster import ClusterConfig, LocalCluster
from pdserve.v1 import common_pb2, router_pb2
from tests.faults.faults_util import survivors_hold_nothing
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
KEY, OTHER_KEY = "sk-test-4f9a1c7e2b", "sk-test-rotated-88d3"
PROMPT_BYTES = 4 << 20  # a prompt this long takes seconds to tokenize here


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# one key per line\n{KEY}\n")
    return path


@pytest.fixture(scope="module")
def cluster(
    llama_dir: Path, key_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        log_dir=tmp_path_factory.mktemp("logs"),
        router_args=(
            "--api-key-file", str(key_file),
            "--max-prompt-bytes", str(PROMPT_BYTES),
            "--max-request-bytes", str(PROMPT_BYTES + (1 << 20)),
        ),
    )  # fmt: skip
    with LocalCluster(config) as c:
        yield c


def _call(
    address: str, request: router_pb2.GenerateRequest | bytes, key: str | None = KEY
) -> list[router_pb2.GenerateResponse]:
    """A sync stream; ``bytes`` go on the wire as they are (invalid UTF-8, say)."""
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    with grpc.insecure_channel(address) as channel:
        generate = channel.unary_stream(
            "/pdserve.v1.Router/Generate",
            request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
            response_deserializer=router_pb2.GenerateResponse.FromString,
        )
        return list(generate(request, metadata=metadata, timeout=120))


def _refusal(
    address: str, request: router_pb2.GenerateRequest | bytes, **kw: object
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        _call(address, request, **kw)  # type: ignore[arg-type]
    return err.value


GREEDY = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
OK = router_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=GREEDY)


def _metric(cluster: LocalCluster, name: str) -> float:
    assert cluster.router is not None
    url = f"http://{cluster.router.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def test_api_keys_no_key_and_wrong_key_are_unauthenticated(
    cluster: LocalCluster, key_file: Path
) -> None:
    for key in (None, "sk-wrong"):
        err = _refusal(cluster.address, OK, key=key)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err  # type: ignore[attr-defined]
    assert _call(cluster.address, OK)[-1].final.usage.completion_tokens == 4
    # Health stays open for probes.
    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # Rotation: a changed file is read again; the old key stops working.
    key_file.write_text(f"{OTHER_KEY}\n")
    _wait_until_accepted(cluster.address, OTHER_KEY)
    err = _refusal(cluster.address, OK, key=KEY)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    key_file.write_text(f"{KEY}\n")
    _wait_until_accepted(cluster.address, KEY)
    assert cluster.router is not None and cluster.config.log_dir is not None
    log = (cluster.config.log_dir / "router.log").read_text()
    assert KEY not in log and OTHER_KEY not in log and "sk-wrong" not in log


def _wait_until_accepted(address: str, key: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _call(address, OK, key=key)
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the rotated key was never accepted"
            time.sleep(0.2)


def test_an_oversized_request_is_refused_before_any_tokenization(cluster: LocalCluster) -> None:
    before = _metric(cluster, "pdserve_tokenizations_total")
    for prompt, code in (
        ("x" * (8 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over --max-request-bytes
        ("x" * (PROMPT_BYTES + 1), grpc.StatusCode.INVALID_ARGUMENT),  # over --max-prompt-bytes
    ):
        err = _refusal(cluster.address, router_pb2.GenerateRequest(prompt=prompt, sampling=GREEDY))
        assert err.code() == code, err  # type: ignore[attr-defined]
    assert _metric(cluster, "pdserve_tokenizations_total") == before


def test_a_long_tokenization_does_not_stall_the_router(cluster: LocalCluster) -> None:
    rng = random.Random(0)
    words = [" ".join(rng.choice("abcdefghij") * rng.randrange(1, 8) for _ in range(40))]
    text = (words[0] + " ") * (PROMPT_BYTES // (len(words[0]) + 1))
    request = router_pb2.GenerateRequest(prompt=text[:PROMPT_BYTES], sampling=GREEDY)

    async def in_flight() -> float:
        return await asyncio.to_thread(_metric, cluster, "pdserve_tokenizations_in_flight")

    async def attempt() -> bool:
        """Whether the router's event loop answered a health check while the tokenization
        was running (False: it ended first, the attempt says nothing)."""
        long = asyncio.create_task(asyncio.to_thread(_refusal, cluster.address, request))

        async def tokenizing() -> bool:
            return await in_flight() == 1

        await wait_for(tokenizing, 60.0, "the long prompt is being tokenized", poll_s=0.01)
        with grpc.insecure_channel(cluster.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await asyncio.to_thread(health.Check, health_pb2.HealthCheckRequest(), timeout=30)
        answered_during = await in_flight() == 1
        err = await long  # far more tokens than max_model_len: refused, after tokenizing
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "max_model_len" in (err.details() or "")  # type: ignore[attr-defined]
        return answered_during

    async def run() -> None:
        # No time bound: on a loaded machine everything is slow. What must hold is the order:
        # the loop answers while a thread tokenizes.
        for _ in range(5):
            if await attempt():
                return
        raise AssertionError("the health check never answered during a tokenization")

    asyncio.run(run())


def test_field_caps_are_refused_by_name_and_a_request_at_the_caps_works(
    cluster: LocalCluster,
) -> None:
    stops = common_pb2.SamplingParams(max_tokens=4, stop=["s"] * 200_000)
    err = _refusal(
        cluster.address, router_pb2.GenerateRequest(prompt_token_ids=[5], sampling=stops)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    details = err.details()  # type: ignore[attr-defined]
    assert "stop has 200000 strings, more than --max-stop-strings (64)" in details
    long_stop = common_pb2.SamplingParams(stop=["x" * 257])
    many_ids = common_pb2.SamplingParams(stop_token_ids=[1] * 257)
    for request, words in (
        (router_pb2.GenerateRequest(prompt_token_ids=[5], request_id="r" * 129, sampling=GREEDY),
         "request_id has 129 bytes, more than --max-request-id-bytes (128)"),
        (router_pb2.GenerateRequest(prompt_token_ids=[5], sampling=long_stop),
         "stop[0] has 257 bytes, more than --max-stop-string-bytes (256)"),
        (router_pb2.GenerateRequest(prompt_token_ids=[5], sampling=many_ids),
         "stop_token_ids has 257 ids, more than --max-stop-token-ids (256)"),
        (router_pb2.GenerateRequest(prompt_token_ids=[5] * 100_000, sampling=GREEDY),
         "prompt_token_ids has 100000 tokens, more than max_model_len 512"),
    ):  # fmt: skip
        err = _refusal(cluster.address, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, words  # type: ignore[attr-defined]
        assert words in err.details(), err.details()  # type: ignore[attr-defined]
    at_caps = common_pb2.SamplingParams(
        max_tokens=4,
        temperature=0.0,
        ignore_eos=True,
        stop=["\u00e9" * 128] * 64,  # 256 bytes each
        stop_token_ids=[1000] * 256,
        logprobs=20,
    )
    request = router_pb2.GenerateRequest(
        prompt_token_ids=[5, 6], request_id="r" * 128, sampling=at_caps
    )
    final = _call(cluster.address, request)[-1].final
    assert final.usage.completion_tokens == 4 and final.request_id == "r" * 128


def test_invalid_utf8_is_invalid_argument_naming_the_field(cluster: LocalCluster) -> None:
    good = router_pb2.GenerateRequest(prompt="hello", request_id="abc", sampling=GREEDY)
    wire = good.SerializeToString()
    for field, bad in (("prompt", wire.replace(b"hello", b"he\xffl\xfe")),
                       ("request_id", wire.replace(b"abc", b"a\xc3("))):  # fmt: skip
        err = _refusal(cluster.address, bad)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert err.details() == f"{field} is not valid UTF-8"  # type: ignore[attr-defined]
    asyncio.run(wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "nothing held"))
