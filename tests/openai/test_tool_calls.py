"""Tool calling through the official ``openai`` client, on a tiny random Qwen2 checkpoint
carrying a Hermes-format tool template (written here), disaggregated: tools reach the template
as transformers passes them (the prompt is transformers' own rendering), tool results render
back, ``auto`` calls are parsed out of the text (the model is steered into writing one with a
regex, since a random model would not), ``required`` and a named function always parse
(structured outputs), streamed and not, and bad tools are named 400s."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from router.openai.tools import MAX_TOOLS
from tests.services.harness import openai_cluster

MODEL = "tiny-tools"
TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these tools, each as <tool_call>{"name": ..., "arguments": ...}</tool_call>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time somewhere.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,  # a random model would invent keys
            },
        },
    },
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tools") / "qwen2-tools"
    shutil.copytree(model_factory("qwen2"), out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # the tiny tokenizer spends many tokens on JSON
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with openai_cluster(model_dir, tmp_path_factory.mktemp("logs"), MODEL) as cluster:
        yield openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, temperature=0.0, **{"messages": ASK, "tools": TOOLS, **kwargs}
    )


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[Any], str | None]:
    content, calls, finish = "", [], None
    for chunk in _create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_the_prompt_is_transformers_rendering_with_tools_and_results(
    client: openai.OpenAI, model_dir: Path
) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = _create(client, messages=history, max_tokens=2, extra_body={"return_token_ids": True})
    hf = AutoTokenizer.from_pretrained(model_dir)
    hf_history = json.loads(json.dumps(history))
    hf_history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = hf.apply_chat_template(
        hf_history, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert r.model_extra["prompt_token_ids"] == hf(want, add_special_tokens=False)["input_ids"]
    assert "<tool_response>\nsunny, 21 C" in want and '"get_time"' in want


@pytest.mark.parametrize("prefix", ["", "Let me check."])
def test_auto_calls_are_parsed_out_of_the_text_streamed_or_not(
    client: openai.OpenAI, prefix: str
) -> None:
    text = f"{prefix}\n{CALL_TEXT}" if prefix else CALL_TEXT
    steer = {"guided_regex": text.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")}
    r = _create(client, max_tokens=80, extra_body=steer)
    message = r.choices[0].message
    assert message.content == (prefix or None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].id
    content, calls, finish = _streamed(client, max_tokens=80, extra_body=steer)
    assert content.strip() == prefix and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", message.tool_calls[0].function.arguments)
    ]


def test_auto_without_a_call_is_content(client: openai.OpenAI) -> None:
    r = _create(client, max_tokens=12, extra_body={"guided_regex": "[a-z ]+"})
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    content, calls, _ = _streamed(client, max_tokens=12, extra_body={"guided_regex": "[a-z ]+"})
    assert content == r.choices[0].message.content and not calls


def test_required_always_parses_into_calls_of_the_tools(
    client: openai.OpenAI, model_dir: Path
) -> None:
    # A random model would list calls until max_tokens: a bias on "]" ends the list once the
    # grammar allows it (the bias moves nothing the grammar forbids).
    close = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("]")
    bias = {"logit_bias": {str(close): 40}}
    r = _create(client, max_tokens=300, tool_choice="required", **bias)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    _, streamed, finish = _streamed(client, max_tokens=300, tool_choice="required", **bias)
    assert finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _create(client, max_tokens=60, tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), CITY)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [TOOLS[0]] * (MAX_TOOLS + 1)}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tools_are_named_400s(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, max_tokens=4, **extra)
    assert (e.value.body or {}).get("param") == param, e.value  # type: ignore[union-attr]
