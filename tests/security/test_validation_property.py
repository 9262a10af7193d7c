"""Property: whatever a client sends, the public API answers with tokens or a named refusal
(INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming the field), never UNKNOWN or INTERNAL, and no
request leaves a block behind."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.local_cluster import ClusterConfig, LocalCluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.faults.faults_util import survivors_hold_nothing
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
# A refusal names its field first ("top_p must be in (0, 1], got 2.0"), or is one of the two
# that name fields otherwise.
FIELDS = re.compile(
    r"^(prompt|prompt_token_ids|request_id|max_tokens|temperature|top_p|top_k|min_p|seed|"
    r"stop(\[\d+\])?|stop_token_ids|logprobs) "
    r"|^set exactly one of prompt and prompt_token_ids$"
    r"|^no (prefill|decode) worker can hold \d+ prompt tokens"
)
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = ClusterConfig(model=str(llama_dir), log_dir=tmp_path_factory.mktemp("logs"))
    with LocalCluster(config) as c:
        yield c


def _mostly(
    valid: st.SearchStrategy[object], invalid: st.SearchStrategy[object]
) -> st.SearchStrategy[object]:
    """Unset, a valid value, or (a third of the time) a value outside the field's range."""
    return st.one_of(st.none(), valid, valid, invalid)


@st.composite
def requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        stop=draw(st.one_of(st.just([]), st.lists(st.text(max_size=6), max_size=4))),
        stop_token_ids=draw(st.one_of(st.just([]), st.lists(st.integers(0, 1500), max_size=4))),
        ignore_eos=draw(st.booleans()),
    )
    for name, strategy in (
        ("max_tokens", _mostly(st.integers(1, 8), st.integers(-3, 0))),
        ("temperature", _mostly(st.floats(0, 2, width=32), st.sampled_from([-1.0, float("nan")]))),
        ("top_p", _mostly(st.floats(0.0625, 1, width=32), st.sampled_from([0.0, 1.5, -1.0]))),
        ("top_k", _mostly(st.integers(-1, 2000), st.integers(-9, -2))),
        ("min_p", _mostly(st.floats(0, 1, width=32), st.sampled_from([-0.5, 1.5]))),
        ("seed", _mostly(st.integers(0, 2**64 - 1), st.nothing())),
        ("logprobs", _mostly(st.integers(0, 20), st.sampled_from([-1, 21, 99]))),
    ):
        value = draw(strategy)
        if value is not None:
            setattr(sampling, name, value)
    request = router_pb2.GenerateRequest(
        sampling=sampling, request_id=draw(st.one_of(st.text(max_size=20), st.text(min_size=129)))
    )
    kind = draw(st.sampled_from(["text", "ids", "text", "ids", "both", "neither"]))
    if kind in ("text", "both"):
        request.prompt = draw(st.one_of(st.text(min_size=1, max_size=60), st.just("")))
    if kind in ("ids", "both"):
        ids = st.lists(st.integers(3, 999), min_size=1, max_size=40)
        bad = st.one_of(st.lists(st.integers(0, 5000), min_size=1, max_size=5), st.just([7] * 600))
        request.prompt_token_ids.extend(draw(st.one_of(ids, ids, bad)))
    return request


def test_every_request_gets_tokens_or_a_named_refusal(cluster: LocalCluster) -> None:
    channel = grpc.insecure_channel(cluster.address)
    stub = router_pb2_grpc.RouterStub(channel)
    outcomes = {"served": 0, "refused": 0}

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(requests())
    def check(request: router_pb2.GenerateRequest) -> None:
        try:
            responses = list(stub.Generate(request, timeout=60))
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
            assert code in REFUSALS, f"{code}: {details} for {request}"
            assert FIELDS.match(details), f"{details!r} names no field"
            outcomes["refused"] += 1
            return
        assert responses[-1].HasField("final")
        outcomes["served"] += 1

    try:
        check()
    finally:
        channel.close()
    assert min(outcomes.values()) >= 5, outcomes  # both kinds of answer were exercised
    asyncio.run(wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "no block left"))
