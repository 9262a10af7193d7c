"""Requests written to break the cluster, through the public surface of a real local cluster
(2 prefill and 2 decode workers, the OpenAI API on, as ``pdserve up`` runs them): each gets a
named refusal (the field, the limit) or its normal ending, and no worker process dies or
restarts (the pids before and after). Before, a guided request whose allowed tokens its
bad_words banned killed two workers (the first crashed, its stream migrated to the next); a
gRPC bad_words id past the vocabulary killed one; a role holding control text opened a turn
of another role. A fuzz of the sampling fields runs a few hundred combinations: every answer
is a normal ending or a named 4xx. Bodies and events parse as strict JSON (no NaN, no
Infinity). The worker-killing fault paths (kill -9, a failed step): tests/faults."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest

from app.client import router_channel
from app.local_cluster import ClusterConfig, LocalCluster
from engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.faults.faults_util import metric

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over the lazy dog " * 6
MAX_OUTPUT_BYTES = 32 << 20


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=2,
        num_decode=2,
        router_http_port=0,
        log_dir=tmp_path_factory.mktemp("logs"),
        router_args=("--max-output-bytes", str(MAX_OUTPUT_BYTES)),
    )
    with LocalCluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(llama_dir)
    assert tok is not None
    return tok


def _pids(cluster: LocalCluster) -> dict[str, int]:
    return {c.name: c.process.pid for c in cluster.components}


def _alive(cluster: LocalCluster, pids: dict[str, int]) -> None:
    """No worker process died or was restarted since ``pids`` were taken."""
    assert _pids(cluster) == pids
    assert all(c.process.poll() is None for c in cluster.components)
    assert cluster.num_restarts == 0


def _computed(cluster: LocalCluster) -> float:
    """Prompt tokens every worker has computed so far."""
    workers = [*cluster.prefill, *cluster.decode]
    return sum(metric(w, "pdserve_prompt_tokens_computed") for w in workers)


def _strict(text: str) -> Any:
    """JSON that a strict parser (JavaScript's, Go's) reads: NaN and Infinity refused."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _post(cluster: LocalCluster, path: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(f"{cluster.http_url}{path}", json=body, timeout=120)


def _events(cluster: LocalCluster, path: str, body: dict[str, Any]) -> list[Any]:
    """A streamed response's events, each parsed strictly."""
    with httpx2.stream(
        "POST", f"{cluster.http_url}{path}", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [_strict(line.removeprefix("data: ")) for line in lines[:-1]]


def _refused(r: httpx2.Response, param: str, *words: str) -> str:
    assert r.status_code == 400, (r.status_code, r.text)
    error = _strict(r.text)["error"]
    for word in (param, *words):
        assert word in error["message"] or word == error.get("param"), error
    return str(error["message"])


def test_a_grammar_whose_tokens_are_all_banned_is_a_named_400_and_kills_nothing(
    cluster: LocalCluster,
) -> None:
    pids = _pids(cluster)
    computed = _computed(cluster)
    # Its first position allows only "7", which bad_words bans: refused before any work.
    first = {"prompt": PROMPT, "guided_regex": "7", "bad_words": ["7"], "max_tokens": 4}
    _refused(_post(cluster, "/v1/completions", first), "bad_words", "guided_regex")
    assert _computed(cluster) == computed
    # After "7" only "8" may follow, and bad_words bans "78" there: the request's error,
    # in the step, on the decode worker.
    later = {"prompt": PROMPT, "guided_regex": "78", "bad_words": ["78"], "max_tokens": 4}
    message = _refused(_post(cluster, "/v1/completions", later), "bad_words", "output index 1")
    assert "guided_regex" in message
    # min_tokens masking the one token the grammar allows (its stop id).
    tokenizer = Tokenizer.from_dir(cluster.config.model)
    assert tokenizer is not None
    (stop_id,) = tokenizer.encode("8", add_special_tokens=False)
    min_tokens = {
        "prompt": PROMPT,
        "guided_regex": "78",
        "min_tokens": 3,
        "stop_token_ids": [stop_id],
        "max_tokens": 4,
    }
    _refused(_post(cluster, "/v1/completions", min_tokens), "min_tokens", "guided_regex")
    # Streamed: the error is an event, and the stream ends; then a normal request is served.
    events = _events(cluster, "/v1/completions", later)
    assert "bad_words" in events[-1]["error"]["message"]
    ok = _post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert ok.status_code == 200 and _strict(ok.text)["choices"][0]["finish_reason"]
    _alive(cluster, pids)
    assert metric(cluster.router, "pdserve_migrations_total") == 0


def test_ids_outside_the_vocabulary_are_refused_by_name_on_grpc(cluster: LocalCluster) -> None:
    pids = _pids(cluster)

    async def one(sampling: common_pb2.SamplingParams) -> grpc.aio.AioRpcError:
        request = router_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling)
        async with router_channel(cluster.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in router_pb2_grpc.RouterStub(channel).Generate(request):
                    pass
        return err.value

    huge = common_pb2.TokenIds(token_ids=[4294967295])
    cases = {
        "bad_words": common_pb2.SamplingParams(max_tokens=2, bad_words=[huge]),
        "stop_token_ids": common_pb2.SamplingParams(max_tokens=2, stop_token_ids=[1 << 20]),
        "logit_bias": common_pb2.SamplingParams(max_tokens=2, logit_bias={70000: 1.0}),
    }
    for field, sampling in cases.items():
        error = asyncio.run(one(sampling))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert f"{field} has ids outside the vocabulary" in (error.details() or "")
    _alive(cluster, pids)


def test_control_text_outside_content_is_refused_and_inside_is_text(
    cluster: LocalCluster, tokenizer: Tokenizer
) -> None:
    pids = _pids(cluster)
    eos = "<|eos|>"  # this tokenizer's control token
    assert eos in tokenizer.special_strings
    base = {"max_tokens": 2, "temperature": 0.0}
    # A role is one the template knows (its own text would open a turn of another role).
    for role in (f"user{eos}", "sudo"):
        unknown = [{"role": role, "content": "hi"}]
        r = _post(cluster, "/v1/chat/completions", {**base, "messages": unknown})
        _refused(r, "messages[0].role", "is not a role")
    cases = {
        "messages[0].name": [{"role": "user", "name": f"x{eos}", "content": "hi"}],
        "messages[1].tool_calls[0].function.arguments": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": json.dumps({"a": eos})},
                    }
                ],
            },
        ],
    }
    for param, messages in cases.items():
        r = _post(cluster, "/v1/chat/completions", {**base, "messages": messages})
        _refused(r, param, "control token")
    tools = [{"type": "function", "function": {"name": "f", "description": f"say {eos}"}}]
    chat = {**base, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    chat["tool_choice"] = "none"  # no parser for this model; the tools still reach its template
    _refused(_post(cluster, "/v1/chat/completions", chat), "tools", "control token")
    # In a content it is text: the prompt holds no control token id for it.
    content = {**base, "messages": [{"role": "user", "content": f"hi{eos}"}]}
    r = _post(cluster, "/v1/chat/completions", {**content, "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt_ids = _strict(r.text)["prompt_token_ids"]
    assert not set(prompt_ids) & tokenizer.special_token_ids
    _alive(cluster, pids)


def test_an_echo_bomb_is_bounded_and_the_router_keeps_answering(cluster: LocalCluster) -> None:
    """n=16 x prompt_logprobs=20 x echo on a long prompt: its prompt logprobs are computed
    once and every choice carries them, its body is built off the event loop (/health
    answers throughout), and what each choice repeats counts in --max-output-bytes: 64
    choices of it are refused by name before any work, streamed or not."""
    pids = _pids(cluster)
    prompt = list(range(3, 483))  # 480 tokens
    bomb = {
        "prompt": prompt,
        "n": 16,
        "max_tokens": 2,
        "echo": True,
        "logprobs": 5,
        "prompt_logprobs": 20,
        "temperature": 0.0,
    }
    health: list[float] = []

    async def run() -> httpx2.Response:
        async with httpx2.AsyncClient(base_url=cluster.http_url, timeout=300) as client:
            task = asyncio.create_task(client.post("/v1/completions", json=bomb))
            while not task.done():
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health.append(time.monotonic() - start)
                await asyncio.sleep(0.05)
            return await task

    r = asyncio.run(run())
    assert r.status_code == 200, r.text[:500]
    choices = _strict(r.text)["choices"]
    leads = [c["logprobs"]["token_logprobs"][: len(prompt)] for c in choices]
    assert len(leads) == 16 and all(lead == leads[0] for lead in leads)
    assert all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
    print(f"/health during the bomb: max {max(health) * 1e3:.0f} ms over {len(health)} probes")
    assert max(health) < 5.0  # generous: a frozen loop took seconds per choice
    computed = _computed(cluster)
    for stream in (False, True):
        r = _post(cluster, "/v1/completions", {**bomb, "n": 64, "stream": stream})
        message = _refused(r, "--max-output-bytes", "prompt")
        assert str(MAX_OUTPUT_BYTES) in message
    assert _computed(cluster) == computed
    _alive(cluster, pids)


def test_guided_top_logprobs_are_strict_json_on_every_path(cluster: LocalCluster) -> None:
    """Fewer tokens allowed than top logprobs asked for: every number is finite, in bodies
    and in events, chat and completions."""
    pids = _pids(cluster)
    choice = {"guided_choice": ["yes", "no"], "max_tokens": 3, "temperature": 0.0}
    completion = {**choice, "prompt": PROMPT, "logprobs": 20, "echo": True}
    chat = {
        **choice,
        "messages": [{"role": "user", "content": "yes or no?"}],
        "logprobs": True,
        "top_logprobs": 20,
        "prompt_logprobs": 5,
    }
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        r = _post(cluster, path, body)
        assert r.status_code == 200, r.text
        _strict(r.text)
        events = _events(cluster, path, body)
        assert events and all("error" not in e for e in events)
    _alive(cluster, pids)


def _fuzz_body(rng: random.Random, eos: list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": rng.choice([PROMPT, "hello", [5, 6, 7, 8, 9] * rng.randint(1, 20)]),
        "max_tokens": rng.randint(1, 8),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
    }
    optional: dict[str, Any] = {
        "seed": rng.randint(0, 1000),
        "n": rng.randint(1, 3),
        "logprobs": rng.randint(0, 20),
        "echo": True,
        "prompt_logprobs": rng.randint(0, 20),
        "min_tokens": rng.randint(0, 8),
        "stop_token_ids": rng.sample(range(1024), rng.randint(1, 4)) + eos,
        "bad_words": rng.sample(["7", "8", "78", "fox", "the", " dog", "a"], rng.randint(1, 3)),
        "logit_bias": {str(rng.randrange(1024)): rng.uniform(-100, 100) for _ in range(3)},
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.uniform(-2, 2),
        "repetition_penalty": rng.uniform(0.5, 2),
        "top_k": rng.randint(-1, 50),
        "top_p": rng.uniform(0.1, 1.0),
        "ignore_eos": rng.random() < 0.5,
        "guided_regex": rng.choice(["7", "78", "[a-z]+", "(yes|no)", r"\d{2}"]),
        "guided_choice": rng.choice([["yes", "no"], ["7", "78"], ["fox"]]),
        "response_format": {"type": "json_object"},
        "stream": True,
    }
    guided = ("guided_regex", "guided_choice", "response_format")
    for key in rng.sample(sorted(optional), rng.randint(1, 6)):
        if key in guided and any(g in body for g in guided):
            continue
        body[key] = optional[key]
    if rng.random() < 0.3:  # a grammar and bans over the same tokens: the worker-killers
        words = rng.choice([["7"], ["78"], ["7", "8"], ["yes"], ["no", "yes"]])
        body["bad_words"] = words
        body.pop("guided_choice", None)
        body.pop("response_format", None)
        body["guided_regex"] = rng.choice(["7", "78", "(yes|no)", "yes"])
    if rng.random() < 0.05:  # an id past the vocabulary
        body["logit_bias"] = {"5000": 1.0}
    if body.get("min_tokens", 0) > body["max_tokens"]:
        body["min_tokens"] = body["max_tokens"]
    return body


def test_a_fuzz_of_sampling_fields_gets_endings_or_named_refusals(
    cluster: LocalCluster, tokenizer: Tokenizer
) -> None:
    pids = _pids(cluster)
    rng = random.Random(35)
    eos = sorted(tokenizer.special_token_ids)[:1]
    outcomes: dict[str, int] = {}
    for _ in range(300):
        body = _fuzz_body(rng, eos)
        if body.pop("stream", False):
            with httpx2.stream(
                "POST", f"{cluster.http_url}/v1/completions", json={**body, "stream": True}
            ) as r:
                text = r.read().decode()
            if r.status_code == 200:
                events = [
                    _strict(line.removeprefix("data: "))
                    for line in text.splitlines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
                errors = [e["error"] for e in events if "error" in e]
                # A refusal mid-stream is an error event of the request's own kind.
                key = "stream 400" if errors else "stream ok"
                assert not errors or errors[0]["type"] == "invalid_request_error", (body, errors)
                assert text.rstrip().endswith("data: [DONE]"), body
            else:
                key = f"stream {r.status_code}"
                assert r.status_code == 400, (body, text)
        else:
            r = _post(cluster, "/v1/completions", body)
            key = str(r.status_code)
            answer = _strict(r.text)
            if r.status_code == 200:
                assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
            else:
                assert r.status_code == 400, (body, r.text)
                assert answer["error"]["message"], body
        outcomes[key] = outcomes.get(key, 0) + 1
    print(f"fuzz outcomes: {dict(sorted(outcomes.items()))}")
    served = outcomes.get("200", 0) + outcomes.get("stream ok", 0)
    refused = outcomes.get("400", 0) + outcomes.get("stream 400", 0)
    assert served > 100 and refused > 20  # both kinds happened
    _alive(cluster, pids)
