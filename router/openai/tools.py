"""A chat request's tools and ``tool_choice``, validated and planned (pure).

- ``none``: the tools still reach the chat template (vLLM's default), nothing is parsed.
- ``auto`` (the default when tools are given): the model decides; its text is parsed with the
  family's parser (``router/openai/tool_parsers.py``). Needs a parser: ``--tool-call-parser``
  or one the chat template implies; else a 400 naming ``tool_choice``.
- ``required``: the output is constrained (structured outputs) to a JSON list of one or more
  ``{"name": <a tool>, "parameters": {...}}``: it always parses, whatever the model family.
- a named function: the output is constrained to that function's parameters schema and is
  its arguments.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from engine.structured_output import (
    MAX_SCHEMA_DEPTH,
    StructuredKind,
    StructuredOutput,
    json_depth,
)
from router.openai.invalid_parameter import InvalidParameter
from router.openai.tool_parsers import PARSERS, ToolCall, ToolParser, ToolStream

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 64 * 1024  # every tool's definition, as JSON
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template, as transformers passes them
    mode: ToolMode
    name: str | None = None  # NAMED: the function
    structured: StructuredOutput | None = None  # REQUIRED / NAMED: the output's constraint
    parser: ToolParser | None = None  # AUTO: how calls are read back

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        if self.mode is ToolMode.NAMED:
            assert self.name is not None
            return None, [ToolCall(self.name, text)]
        if self.mode is ToolMode.REQUIRED:
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short (length): no call to report
            return None, [ToolCall(i["name"], json.dumps(i["parameters"])) for i in items]
        if self.mode is ToolMode.AUTO:
            assert self.parser is not None
            return self.parser.parse(text)
        return text, []

    def finish_reason(self, calls: list[ToolCall], finish_reason: str | None) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call (auto, required); a named
        function's call ends with ``stop``."""
        chose = calls and self.mode is not ToolMode.NAMED and finish_reason == "stop"
        return "tool_calls" if chose else finish_reason

    def stream(self) -> ToolStream | None:
        """A streamed choice's reader; None when nothing is parsed (``none``)."""
        if self.mode is ToolMode.NONE:
            return None
        return ToolStream(self.calls, self.parser)


NO_TOOLS = ToolPlan(None, ToolMode.NONE)


def tool_plan(tools: list[Any] | None, tool_choice: Any, parser_name: str | None) -> ToolPlan:
    """Raises InvalidParameter naming ``tools[i]...`` or ``tool_choice``."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidParameter("tool_choice", "tool_choice needs tools")
        return NO_TOOLS
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(tools, ToolMode.NONE)
    if choice == "auto":
        if parser_name is None:
            raise InvalidParameter(
                "tool_choice",
                "tool_choice 'auto' needs a tool call parser for this model: start the router "
                f"with --tool-call-parser (one of {', '.join(PARSERS)})",
            )
        return ToolPlan(tools, ToolMode.AUTO, parser=PARSERS[parser_name]())
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return ToolPlan(tools, ToolMode.REQUIRED, structured=_constraint(schema))
    name = _named(choice)
    if name not in functions:
        raise InvalidParameter(
            "tool_choice", f"tool_choice names {name!r}, which is not one of the tools"
        )
    return ToolPlan(tools, ToolMode.NAMED, name, _constraint(functions[name]))


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, every tool checked."""
    if len(tools) > MAX_TOOLS:
        raise InvalidParameter("tools", f"{len(tools)} tools, more than {MAX_TOOLS}")
    size = len(json.dumps(tools))
    if size > MAX_TOOLS_BYTES:
        raise InvalidParameter(
            "tools", f"tools are {size} bytes of JSON, more than {MAX_TOOLS_BYTES}"
        )
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidParameter(f"{where}.type", f"{where}.type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidParameter(f"{where}.function", f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidParameter(
                f"{where}.function.name",
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
            )
        if name in out:
            raise InvalidParameter(f"{where}.function.name", f"{where}: {name!r} appears twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidParameter(
                f"{where}.function.parameters", f"{where}.function.parameters must be a schema"
            )
        out[name] = parameters
    return out


def _named(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    raise InvalidParameter(
        "tool_choice",
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
    )


def _constraint(schema: dict[str, Any]) -> StructuredOutput:
    try:
        return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema), "tool_choice")
    except ValueError as e:
        raise InvalidParameter("tools", str(e).replace("tool_choice", "tools", 1)) from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as chat templates read them: ``arguments`` as an object
    (clients send OpenAI's JSON text; transformers' templates expect a mapping)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            out.append(message)
            continue
        converted = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    raise InvalidParameter(where, f"{where} is not valid JSON") from None
                except RecursionError:  # nested past Python's stack: a refusal, not a bug
                    raise InvalidParameter(where, f"{where} nests too deep") from None
                if json_depth(arguments) > MAX_SCHEMA_DEPTH:  # the bound on a tool's schema too
                    raise InvalidParameter(
                        where, f"{where} nests more than {MAX_SCHEMA_DEPTH} deep"
                    )
                call = {**call, "function": {**function, "arguments": arguments}}  # type: ignore[dict-item]
            converted.append(call)
        out.append({**message, "tool_calls": converted})
    return out
