"""The OpenAI API's pure parts, with exact values: request bodies into plans, refusals by
name, the error map, and the response shapes (usage, both logprobs formats, chunks)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pydantic
import pytest

from engine.sampling_params import MAX_INT32, SamplingParams
from engine.sequence import TokenLogprobs
from router.openai import errors
from router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParameter,
    Prompt,
    message_dicts,
    parse_chat,
    parse_completion,
)
from router.openai.responses import (
    ChoiceOutput,
    Envelope,
    Kind,
    TokenText,
    chunk_body,
    response_body,
    usage_chunk,
)
from router.openai.tools import tool_plan
from router.prompts import Overloaded
from router.worker_errors import WorkerError


def completion(**body: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **body})


def chat(**body: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **body})


def test_a_completion_plan_sets_only_what_was_given() -> None:
    parsed = parse_completion(
        completion(prompt=[[1, 2], [3]], n=3, seed=5, temperature=0.5, stop="x", top_k=4),
        max_choices=64,
    )
    assert parsed.prompts == (Prompt(token_ids=(1, 2)), Prompt(token_ids=(3,)))
    assert parsed.num_choices == 6 and parsed.seed == 5 and not parsed.fill_context
    expected = SamplingParams(max_tokens=16, temperature=0.5, top_k=4, stop=["x"])
    assert parsed.sampling == expected  # OpenAI's default of 16 tokens; no seed inside
    assert parsed.logprobs is None and not parsed.stream and not parsed.include_usage


def test_prompt_shapes() -> None:
    for prompt, want in (
        ("a", (Prompt(text="a"),)),
        (["a", "b"], (Prompt(text="a"), Prompt(text="b"))),
        ([1, 2, 3], (Prompt(token_ids=(1, 2, 3)),)),
        ([[1], [2, 3]], (Prompt(token_ids=(1,)), Prompt(token_ids=(2, 3)))),
    ):
        assert parse_completion(completion(prompt=prompt), 64).prompts == want
    with pytest.raises(InvalidParameter) as err:
        parse_completion(completion(prompt=[]), 64)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameter) as err:
        parse_completion(completion(prompt=[[1], [-1]]), 64)
    assert err.value.param == "prompt[1]"


def test_a_chat_plan_fills_the_context_and_maps_logprobs() -> None:
    parsed = parse_chat(chat(logprobs=True, top_logprobs=3), Prompt(text="rendered"), 64)
    assert parsed.prompts == (Prompt(text="rendered"),) and parsed.fill_context
    assert parsed.logprobs == 3 and parsed.sampling.logprobs == 3
    assert parsed.sampling.max_tokens == MAX_INT32  # the serving layer fills the context
    capped = parse_chat(chat(max_completion_tokens=7, max_tokens=99), Prompt(text="r"), 64)
    assert capped.sampling.max_tokens == 7 and not capped.fill_context
    assert parse_chat(chat(logprobs=True), Prompt(text="r"), 64).logprobs == 0
    streamed = parse_chat(
        chat(stream=True, stream_options={"include_usage": True}), Prompt(text="r"), 64
    )
    assert streamed.stream and streamed.include_usage


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: parse_completion(completion(logit_bias={"x5": 1.0}), 64), "logit_bias"),
        (lambda: parse_completion(completion(logit_bias={str(i): 1.0 for i in range(301)}), 64),
         "logit_bias"),
        (lambda: parse_completion(completion(prompt_logprobs=21), 64), "prompt_logprobs"),
        (lambda: parse_completion(completion(n=65), 64), "n"),
        (lambda: parse_completion(completion(prompt=["a"] * 9, n=8), 64), "n"),
        (lambda: parse_completion(completion(seed=-1), 64), "seed"),
        (lambda: parse_completion(completion(logprobs=21), 64), "logprobs"),
        (lambda: parse_completion(completion(top_k=1 << 40), 64), "top_k"),
        (lambda: parse_completion(completion(stream_options={"include_usage": True}), 64),
         "stream_options"),
        (lambda: parse_chat(chat(top_logprobs=2), Prompt(text="r"), 64), "top_logprobs"),
        (lambda: tool_plan([{"type": "function"}], None, None), "tools[0].function"),
        (lambda: parse_chat(chat(response_format={"type": "xml"}), Prompt(text="r"), 64),
         "response_format.type"),
    ],
)  # fmt: skip
def test_unsupported_or_bad_fields_are_refused_by_name(build: Any, param: str) -> None:
    with pytest.raises(InvalidParameter) as err:
        build()
    assert err.value.param == param and param.split("[")[0] in str(err.value)


def test_zero_penalties_and_unknown_fields_pass() -> None:
    parsed = parse_completion(
        completion(presence_penalty=0, frequency_penalty=0.0, user="u", something_new=1), 64
    )
    assert parsed.num_choices == 1


def test_penalties_bias_and_min_tokens_reach_the_sampling_params() -> None:
    body = completion(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias={"5": 2.0, "9": -100},
        min_tokens=3,
    )
    sampling = parse_completion(body, 64).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.25)
    assert sampling.repetition_penalty == 1.2 and sampling.min_tokens == 3
    assert dict(sampling.logit_bias) == {5: 2.0, 9: -100.0}


def test_messages_become_template_dicts() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                ]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            ],
        }
    )  # fmt: skip
    assert message_dicts(body) == [
        {"role": "system", "content": "a\nb"},
        {"role": "assistant", "tool_calls": [{"id": "1"}]},
    ]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(InvalidParameter) as err:
        message_dicts(chat(messages=[{"role": "user", "content": image}]))
    assert err.value.param == "messages[0].content[0].type"
    with pytest.raises(InvalidParameter) as err:
        message_dicts(chat(messages=[]))
    assert err.value.param == "messages"


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        CompletionRequest.model_validate({"prompt": {"not": "valid"}})
    error = errors.from_validation(err.value)
    assert (error.status, error.param) == (400, "prompt")
    assert error.message.startswith("prompt: must be a string, a list of strings")
    with pytest.raises(pydantic.ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"content": "x"}]})
    assert errors.from_validation(err.value).param == "messages[0].role"
    with pytest.raises(pydantic.ValidationError) as err:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0})
    assert errors.from_validation(err.value).param == "max_tokens"


def test_the_error_map() -> None:
    # A ValueError is the client's only while its request is read and checked (refusal).
    refusals: list[tuple[ValueError, str | None]] = [
        (ValueError("temperature must be a finite number >= 0, got -1"), "temperature"),
        (ValueError("prompt_token_ids has 600 tokens, more than max_model_len 512"), "prompt"),
        (ValueError("no decode worker can hold 9999 prompt tokens"), None),
        (
            InvalidParameter("messages[0].role", "messages[0].role 'x' is not a role"),
            "messages[0].role",
        ),
    ]
    for value_error, param in refusals:
        refused = errors.refusal(value_error)
        assert (refused.status, refused.param) == (400, param), value_error
        # Past the reading, the same is a bug: 500, its text to the log, not to the client.
        if not isinstance(value_error, InvalidParameter):
            assert errors.from_exception(value_error) is None
    cases: list[tuple[BaseException, int, str | None, str | None]] = [
        (Overloaded("64 prompts are waiting"), 429, None, "1"),
        (WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker 10.0.0.1:5: full"), 429,
         None, "1"),
        (WorkerError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker"), 503, None, "1"),
        (WorkerError(grpc.StatusCode.INVALID_ARGUMENT, "seed must be >= 0"), 400, "seed", None),
        # The cluster's state, not a bug (before: 500, logged as one).
        (WorkerError(grpc.StatusCode.PERMISSION_DENIED, "10.0.0.1:5 is no known peer"), 503,
         None, "1"),
        (WorkerError(grpc.StatusCode.FAILED_PRECONDITION, "10.0.0.1:5 serves model B"), 503,
         None, "1"),
        (WorkerError(grpc.StatusCode.DATA_LOSS, "10.0.0.1:5: digest differs"), 503, None, "1"),
    ]  # fmt: skip
    for exc, status, param, retry in cases:
        error = errors.from_exception(exc)
        assert error is not None, exc
        assert (error.status, error.param, error.headers().get("Retry-After")) == (
            status, param, retry
        ), exc  # fmt: skip
        assert "10.0.0.1" not in error.message  # no internal addresses to clients
    assert errors.from_exception(WorkerError(grpc.StatusCode.INTERNAL, "boom")) is None
    assert errors.from_exception(KeyError("x")) is None
    assert errors.internal("r1").body() == {
        "error": {
            "message": "internal error (request id r1)",
            "type": "internal_error",
            "param": None,
            "code": "internal_error",
        }
    }


ENTRIES = [
    TokenLogprobs(token_id=1, logprob=-0.5, top_token_ids=(1, 2), top_logprobs=(-0.5, -1.5)),
    TokenLogprobs(token_id=2, logprob=-0.25, top_token_ids=(2,), top_logprobs=(-0.25,)),
]


class _Text(TokenText):
    def __init__(self) -> None:
        super().__init__(None)

    def __call__(self, token_id: int) -> str:
        return {1: "ab", 2: "é"}[token_id]


def test_response_bodies_usage_and_logprobs() -> None:
    text = _Text()
    choices = [
        ChoiceOutput(0, 0, [7, 8, 9], ["ab", "é"], [1, 2], list(ENTRIES), "length", 3, 2),
        ChoiceOutput(1, 0, [7, 8, 9], ["ab"], [1], ENTRIES[:1], "stop", 3, 1),
    ]
    env = Envelope(Kind.COMPLETION, "cmpl-r", 100, "m", True, True)
    body = response_body(env, choices, text)
    assert body["usage"] == {
        "prompt_tokens": 3,  # one prompt, n=2: counted once
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 3},
        "timings": [
            {"index": 0, "ttft_s": 0.0, "phases_s": {}},
            {"index": 1, "ttft_s": 0.0, "phases_s": {}},
        ],
    }
    first = body["choices"][0]
    assert first["logprobs"] == {
        "tokens": ["ab", "é"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"ab": -0.5, "é": -1.5}, {"é": -0.25}],
        "text_offset": [0, 2],
    }
    assert (first["token_ids"], first["prompt_token_ids"]) == ([1, 2], [7, 8, 9])
    chat_env = Envelope(Kind.CHAT, "chatcmpl-r", 100, "m", True, True)
    chat_body = response_body(chat_env, choices[:1], text)
    assert chat_body["object"] == "chat.completion" and chat_body["prompt_token_ids"] == [7, 8, 9]
    assert chat_body["choices"][0]["message"] == {"role": "assistant", "content": "abé"}
    assert chat_body["choices"][0]["logprobs"]["content"][1] == {
        "token": "é",
        "logprob": -0.25,
        "bytes": [195, 169],
        "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]}],
    }


def test_chunks() -> None:
    text = _Text()
    c = ChoiceOutput(0, 0, [7, 8])
    env = Envelope(Kind.CHAT, "chatcmpl-r", 100, "m", False, True)
    opening = chunk_body(env, c, "", [], [], text, first=True, include_usage=True)
    assert opening == {
        "id": "chatcmpl-r",
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None, "token_ids": []}
        ],
        "prompt_token_ids": [7, 8],
        "usage": None,
    }  # fmt: skip
    tokens = chunk_body(env, c, "ab", [1], ENTRIES[:1], text)
    assert tokens["choices"][0]["delta"] == {"content": "ab"}
    assert tokens["choices"][0]["token_ids"] == [1] and "usage" not in tokens
    end = chunk_body(env, c, "", [], [], text, finish_reason="stop")
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    completion_env = Envelope(Kind.COMPLETION, "cmpl-r", 100, "m", True, False)
    legacy = chunk_body(completion_env, c, "ab", [1], ENTRIES[:1], text, first=True)
    assert legacy["choices"][0]["text"] == "ab"
    assert legacy["choices"][0]["logprobs"]["text_offset"] == [0]
    again = chunk_body(completion_env, c, "é", [2], ENTRIES[1:], text)
    assert again["choices"][0]["logprobs"]["text_offset"] == [2]  # continues the choice's text
    c.num_tokens += 2  # what the stream counted (it keeps no tokens)
    assert usage_chunk(completion_env, [c])["usage"]["completion_tokens"] == 2


def test_null_means_the_default_and_types_are_strict() -> None:
    nulls = {
        "n": None, "stream": None, "echo": None, "ignore_eos": None, "return_token_ids": None,
        "stream_options": None, "logprobs": None, "max_tokens": None, "temperature": None,
    }  # fmt: skip
    parsed = parse_completion(
        CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **nulls})), 64
    )
    assert (parsed.n, parsed.stream, parsed.logprobs, parsed.return_token_ids) == (
        1,
        False,
        None,
        False,
    )
    chat_nulls = {"logprobs": None, "add_generation_prompt": None, "top_logprobs": None}
    body = {"messages": [{"role": "user", "content": "x"}], **chat_nulls}
    assert (
        parse_chat(
            ChatCompletionRequest.model_validate_json(json.dumps(body)), Prompt(text="r"), 64
        ).n
        == 1
    )
    for field, value in (("logprobs", True), ("n", "2"), ("stream", 1), ("max_tokens", 2.5)):
        with pytest.raises(pydantic.ValidationError) as err:
            CompletionRequest.model_validate_json(json.dumps({"prompt": "x", field: value}))
        assert errors.from_validation(err.value).param == field
    with pytest.raises(InvalidParameter) as refused:
        parse_chat(chat(logprobs=True, top_logprobs=21), Prompt(text="r"), 64)
    assert refused.value.param == "top_logprobs"
    with pytest.raises(InvalidParameter) as refused:
        parse_chat(chat(functions=[{"name": "f"}]), Prompt(text="r"), 64)
    assert refused.value.param == "functions"
    with pytest.raises(InvalidParameter) as refused:
        tool_plan(None, "auto", None)  # tool_choice without tools
    assert refused.value.param == "tool_choice"


def test_bodies_that_are_not_json_objects() -> None:
    for data in (b"{nope", b"[1, 2]", b"[" * 100_000):
        with pytest.raises(pydantic.ValidationError) as err:
            CompletionRequest.model_validate_json(data)
        assert errors.from_validation(err.value).param == "body", data[:10]


def test_a_chat_without_max_tokens_may_ask_min_tokens_past_the_engines_default() -> None:
    """Its max_tokens is the context left after the prompt (filled by the serving layer), so
    min_tokens is held to that, not to the 16 a request without one gets elsewhere."""
    parsed = parse_chat(chat(min_tokens=20), Prompt(text="r"), 64)
    assert parsed.fill_context and parsed.sampling.min_tokens == 20
    assert parsed.sampling.max_tokens == MAX_INT32


def test_an_engine_check_of_a_sampling_value_names_its_param() -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(max_tokens=2, min_tokens=3)
    assert errors.refusal(err.value).body()["error"]["param"] == "min_tokens"
