"""Structured outputs on the real chat model, through the official ``openai`` client against
a disaggregated cluster (every prompt prefilled on one worker, decoded on another): a Pydantic
model parses, seeded JSON-schema outputs validate, regex and choice constraints hold, the
served tokens are one engine's, and what cannot or should not compile is a named 400."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from app.local_cluster import LocalCluster
from engine import SamplingParams
from engine.structured_output import MAX_SPEC_BYTES, StructuredKind, StructuredOutput
from native_engine import LLM
from tests.integration.test_real_model import hf_prompt
from tests.services.harness import openai_cluster

pytestmark = pytest.mark.slow

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age and hobbies."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def cluster(
    chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with openai_cluster(chat_model_dir, tmp_path_factory.mktemp("logs"), MODEL) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)


def test_the_openai_client_parses_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, max_tokens=80, temperature=0.0
    )  # type: ignore[arg-type]
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and r.choices[0].finish_reason == "stop"


def test_twenty_seeded_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        n=20,
        seed=1,
        temperature=0.8,
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    )
    assert len(r.choices) == 20
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_served_guided_tokens_are_one_engines_streamed_or_not(
    client: openai.OpenAI, chat_model_dir: Path
) -> None:
    so = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA), "guided_json")
    body = {"guided_json": SCHEMA, "return_token_ids": True}
    r: Any = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0.0, extra_body=body
    )  # type: ignore[arg-type]
    engine = LLM(str(chat_model_dir), max_model_len=1024)
    params = SamplingParams(max_tokens=120, temperature=0.0, structured=so)
    (ref,) = engine.generate([hf_prompt(chat_model_dir, ASK)], params)
    assert r.choices[0].model_extra["token_ids"] == ref.token_ids
    assert r.choices[0].message.content == ref.text
    chunks = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0.0, stream=True, extra_body=body
    )  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"guided_regex": r"\d{3}-\d{4}"}, r"\d{3}-\d{4}"),
        ({"guided_choice": ["yes", "no"]}, "yes|no"),
        ({"structured_outputs": {"choice": ["Paris", "Lyon"]}}, "Paris|Lyon"),
        ({"structured_outputs": {"regex": "[A-Z][a-z]+"}}, "[A-Z][a-z]+"),
    ],
)
def test_regex_and_choice_hold(client: openai.OpenAI, body: dict[str, Any], check: str) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
        temperature=0.0,
        extra_body=body,
    )
    assert re.fullmatch(check, r.choices[0].message.content or ""), r.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
            "cannot be compiled",
        ),
        (
            {"guided_json": {"type": "object", "description": "x" * MAX_SPEC_BYTES}},
            "guided_json",
            f"more than {MAX_SPEC_BYTES}",
        ),
        ({"guided_regex": "([a-z]"}, "guided_regex", "cannot be compiled"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text'"),
    ],
)
def test_what_cannot_or_should_not_compile_is_a_named_400(
    client: openai.OpenAI, extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=8,
            extra_body=extra,  # type: ignore[arg-type]
        )
    assert e.value.status_code == 400 and message in str(e.value)
    assert (e.value.body or {}).get("param") == param  # type: ignore[union-attr]
