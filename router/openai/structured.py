"""The OpenAI (and vLLM) request fields that constrain an output's form, read into one
``StructuredOutput``: ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``) and its older ``guided_json``,
``guided_regex``, ``guided_choice``. At most one may be given; each refusal names its field.
Whether the grammar compiles is the worker's to say (``engine/guide.py``), before any token.
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured_output import StructuredKind, StructuredOutput
from router.openai.invalid_parameter import InvalidParameter

_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice")


def structured_output(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided_json: dict[str, Any] | str | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
) -> StructuredOutput | None:
    """The one constraint a request asks for, or None. Raises InvalidParameter."""
    found = []
    if response_format is not None and response_format.get("type") != "text":
        found.append(_response_format(response_format))
    if structured_outputs:
        found.append(_structured_outputs(structured_outputs))
    if guided_json is not None:
        found.append(_schema("guided_json", guided_json))
    if guided_regex is not None:
        found.append(_make("guided_regex", StructuredKind.REGEX, guided_regex))
    if guided_choice is not None:
        found.append(_choice("guided_choice", guided_choice))
    if len(found) > 1:
        names = ", ".join(so.field.split(".")[0] for so in found)
        raise InvalidParameter(found[1].field, f"give one output constraint, not several ({names})")
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> StructuredOutput:
    kind = value.get("type")
    if kind == "json_object":
        return _make("response_format", StructuredKind.JSON_OBJECT, "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidParameter(
                "response_format.json_schema",
                "response_format type 'json_schema' needs json_schema.schema",
            )
        return _schema("response_format.json_schema.schema", spec["schema"])
    raise InvalidParameter(
        "response_format.type",
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
    )


def _structured_outputs(value: dict[str, Any]) -> StructuredOutput:
    given = [k for k in value if value[k] is not None]
    unknown = [k for k in given if k not in _STRUCTURED_OUTPUTS_KEYS]
    if unknown:
        raise InvalidParameter(
            f"structured_outputs.{unknown[0]}",
            f"structured_outputs.{unknown[0]} is not supported (supported: "
            f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)})",
        )
    if len(given) != 1:
        raise InvalidParameter("structured_outputs", "structured_outputs needs exactly one key")
    key = given[0]
    field = f"structured_outputs.{key}"
    if key == "json":
        return _schema(field, value[key])
    if key == "regex":
        return _make(field, StructuredKind.REGEX, value[key])
    return _choice(field, value[key])


def _schema(field: str, schema: object) -> StructuredOutput:
    if isinstance(schema, str):
        text = schema
    elif isinstance(schema, dict | bool):
        text = json.dumps(schema)
    else:
        raise InvalidParameter(field, f"{field} must be a JSON schema object")
    return _make(field, StructuredKind.JSON_SCHEMA, text)


def _choice(field: str, choices: object) -> StructuredOutput:
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise InvalidParameter(field, f"{field} must be a list of strings")
    return _make(field, StructuredKind.CHOICE, json.dumps(choices))


def _make(field: str, kind: StructuredKind, spec: object) -> StructuredOutput:
    if not isinstance(spec, str):
        raise InvalidParameter(field, f"{field} must be a string")
    try:
        return StructuredOutput(kind, spec, field)
    except ValueError as e:
        raise InvalidParameter(field, str(e)) from None
