"""Reading tool calls back out of a model's text, one parser per model family's format
(``--tool-call-parser``; unset: detected from the chat template).

- ``hermes``: Hermes, Qwen2.5, Qwen3 and most ChatML tool templates: each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first call
  is content.
- ``llama3_json``: Llama 3.1-3.3: the whole output is one call, or several separated by
  ``;``, as ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``.

Who calls: the OpenAI serving layer, once per choice: ``parse`` on a whole text (non-streamed),
``ToolStream`` on a streamed one. Output that does not parse as calls stays content, as in
vLLM: a model that declined to call a tool answered in words.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = ""

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


class ToolParser(abc.ABC):
    @abc.abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output. No calls: the text is all content."""

    @abc.abstractmethod
    def opening_at(self, text: str, started: bool) -> int | None:
        """Where in ``text`` (the unstreamed tail of an output) a call may begin, or None;
        ``started``: content was streamed before it."""

    @abc.abstractmethod
    def held_suffix(self, text: str, started: bool) -> int:
        """How much of the end of ``text`` to hold back: it may still become an opening."""


class HermesParser(ToolParser):
    opening = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.opening)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            call = _call(body, "arguments")
            if call is None:
                return text, []  # a malformed call: the text stays, nothing is made up
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def opening_at(self, text: str, started: bool) -> int | None:
        at = text.find(self.opening)
        return at if at >= 0 else None

    def held_suffix(self, text: str, started: bool) -> int:
        return _partial_suffix(text, self.opening)


class Llama3JsonParser(ToolParser):
    _TAG = "<|python_tag|>"
    # Leading text held while it may still open a call (blanks, part of the tag): past this
    # much it is content, so that a flood of blanks costs a bounded scan per token.
    _UNDECIDED_MAX = 256

    def opening_at(self, text: str, started: bool) -> int | None:
        """The format is the whole output: a call can only open it."""
        if started or len(text) > self._UNDECIDED_MAX + len(self._TAG):
            return None
        head = text.lstrip()
        return 0 if head.startswith("{") or head.startswith(self._TAG) else None

    def held_suffix(self, text: str, started: bool) -> int:
        if started or len(text) > self._UNDECIDED_MAX:
            return 0
        head = text.lstrip()
        return len(text) if not head or self._TAG.startswith(head) else 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(value, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return None, calls


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def detect_parser(template_source: str | None) -> str | None:
    """The parser a chat template's own tool format implies, or None."""
    if template_source is None:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3_json"
    return None


def _call(text: str, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call_of(value, arguments_key)


def _call_of(value: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolStream:
    """One streamed choice of a request with tools. With a parser (``auto``), content passes
    through until text where a call may begin, from which everything is held; without one
    (a constrained call), everything is held. ``finish`` parses what was held."""

    def __init__(
        self, parse: Callable[[str], tuple[str | None, list[ToolCall]]], parser: ToolParser | None
    ) -> None:
        self._parse = parse
        self._parser = parser
        self._started = False  # content already streamed
        self._holding = parser is None
        self._held = ""  # while not holding: the short tail a call may still open in
        self._pieces: list[str] = []  # once holding: every piece since (joined at the end)

    def feed(self, text: str) -> str:
        """The content to stream now. Linear in the output: once holding, pieces are only
        kept; before, the parser looks at a bounded tail."""
        if self._holding or self._parser is None:
            self._pieces.append(text)
            return ""
        self._held += text
        at = self._parser.opening_at(self._held, self._started)
        if at is not None:
            self._holding = True
            emitted = self._emit(self._held[:at])
            self._pieces, self._held = [self._held], ""
            return emitted
        keep = self._parser.held_suffix(self._held, self._started)
        return self._emit(self._held[: len(self._held) - keep])

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """The rest of the content, and the calls the held text makes."""
        held = self._held + "".join(self._pieces)
        content, calls = self._parse(held)
        if not calls:
            return (held or None), []
        return content, calls

    def _emit(self, text: str) -> str:
        self._started = self._started or bool(text)
        self._held = self._held[len(text) :]
        return text


def _partial_suffix(text: str, opening: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``opening``."""
    for n in range(min(len(opening) - 1, len(text)), 0, -1):
        if text.endswith(opening[:n]):
            return n
    return 0
