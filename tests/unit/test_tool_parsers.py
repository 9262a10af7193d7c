"""Tool calls read out of text (router/openai/tool_parsers.py) and tool requests planned
(router/openai/tools.py): exact values, whole and streamed."""

from __future__ import annotations

import json

import pytest

from router.openai.invalid_parameter import InvalidParameter
from router.openai.tool_parsers import HermesParser, Llama3JsonParser, ToolStream, detect_parser
from router.openai.tools import ToolMode, template_messages, tool_plan

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def _calls(parsed: tuple[str | None, list]) -> tuple[str | None, list[tuple[str, object]]]:
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Just words.", ("Just words.", [])),
        (
            'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            ("Sure.", [("f", {"a": 1})]),
        ),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"b": "x"}}</tool_call>',
            (None, [("f", {}), ("g", {"b": "x"})]),
        ),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}', (None, [("f", {"a": 1})])),  # cut
        ("<tool_call>{not json}</tool_call>", ("<tool_call>{not json}</tool_call>", [])),
    ],
)
def test_hermes(text: str, expected: tuple[str | None, list[tuple[str, object]]]) -> None:
    assert _calls(HermesParser().parse(text)) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("It is sunny.", ("It is sunny.", [])),
        ('{"name": "f", "parameters": {"a": 1}}', (None, [("f", {"a": 1})])),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"c": 2}}',
            (None, [("f", {}), ("g", {"c": 2})]),
        ),
        ('{"name": "f", "parameters": 3}', ('{"name": "f", "parameters": 3}', [])),
        ('{"x": 1}', ('{"x": 1}', [])),
    ],
)
def test_llama3_json(text: str, expected: tuple[str | None, list[tuple[str, object]]]) -> None:
    assert _calls(Llama3JsonParser().parse(text)) == expected


@pytest.mark.parametrize(
    ("parser", "text", "streamed"),
    [
        (HermesParser(), 'Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>', "Sure.\n"),
        (HermesParser(), "a < b <tool but no call", "a < b <tool but no call"),
        (Llama3JsonParser(), '  {"name": "f", "parameters": {}}', ""),
        (Llama3JsonParser(), "Plain {braces} later", "Plain {braces} later"),
    ],
)
def test_a_stream_passes_content_and_holds_calls(parser, text: str, streamed: str) -> None:  # type: ignore[no-untyped-def]
    reader = ToolStream(parser.parse, parser)
    out = "".join(reader.feed(ch) for ch in text)  # one character at a time
    rest, calls = reader.finish()
    whole_content, whole_calls = parser.parse(text)
    assert out == streamed
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    if whole_calls:
        assert (out + (rest or "")).strip() == (whole_content or "")
    else:
        assert out + (rest or "") == text


def test_detect_parser_from_the_template() -> None:
    assert detect_parser("... <tool_call> ...") == "hermes"
    assert detect_parser("... <|python_tag|> ...") == "llama3_json"
    assert detect_parser("{{ messages }}") is None and detect_parser(None) is None


def test_plans() -> None:
    assert tool_plan(None, None, None).mode is ToolMode.NONE
    assert tool_plan([WEATHER], "none", None).tools == [WEATHER]
    assert tool_plan([WEATHER], None, "hermes").mode is ToolMode.AUTO
    required = tool_plan([WEATHER], "required", None)
    assert required.structured is not None and json.loads(required.structured.spec) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": "get_weather"},
                        "parameters": {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            ]
        },
    }
    assert [
        (c.name, c.arguments)
        for c in required.calls('[{"name": "get_weather", "parameters": {}}]')[1]
    ] == [("get_weather", "{}")]
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.mode is ToolMode.NAMED and named.structured is not None
    assert named.structured.spec == '{"type": "object"}'
    assert [(c.name, c.arguments) for c in named.calls('{"a": 1}')[1]] == [
        ("get_weather", '{"a": 1}')
    ]


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "param"),
    [
        ([WEATHER], "auto", None, "tool_choice"),
        (None, "required", None, "tool_choice"),
        ([WEATHER], "sometimes", None, "tool_choice"),
        ([WEATHER, WEATHER], "none", None, "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "none",
            None,
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_plans_name_the_field(tools, choice, parser, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidParameter) as e:
        tool_plan(tools, choice, parser)
    assert e.value.param == param


def test_template_messages_give_arguments_as_objects() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    (message,) = template_messages([{"role": "assistant", "tool_calls": [call]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    bad = {**call, "function": {"name": "f", "arguments": "{"}}
    with pytest.raises(InvalidParameter) as e:
        template_messages([{"role": "user"}, {"role": "assistant", "tool_calls": [bad]}])
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
