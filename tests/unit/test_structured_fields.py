"""The request fields that constrain an output (router/openai/structured.py), read into one
StructuredOutput or refused naming the field: exact values."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.structured_output import StructuredKind, StructuredOutput
from router.openai.invalid_parameter import InvalidParameter
from router.openai.structured import structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _read(**fields: Any) -> StructuredOutput | None:
    given: dict[str, Any] = {
        "response_format": None,
        "structured_outputs": None,
        "guided_json": None,
        "guided_regex": None,
        "guided_choice": None,
    }
    return structured_output(**{**given, **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutput(StructuredKind.JSON_OBJECT, "", "response_format"),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            StructuredOutput(
                StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA), "response_format.json_schema.schema"
            ),
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA), "guided_json"),
        ),
        (
            {"guided_regex": "a+"},
            StructuredOutput(StructuredKind.REGEX, "a+", "guided_regex"),
        ),
        (
            {"guided_choice": ["x", "y"]},
            StructuredOutput(StructuredKind.CHOICE, '["x", "y"]', "guided_choice"),
        ),
        (
            {"structured_outputs": {"regex": "b+", "json": None}},
            StructuredOutput(StructuredKind.REGEX, "b+", "structured_outputs.regex"),
        ),
    ],
)
def test_each_field_reads_into_one_constraint(
    fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    assert _read(**fields) == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_json": 7}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
    ],
)
def test_each_refusal_names_its_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameter) as e:
        _read(**fields)
    assert e.value.param == param
