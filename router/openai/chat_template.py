"""A model's chat template, rendered as transformers' ``apply_chat_template`` renders it (the
router stays torch-free: Jinja only).

The template comes from ``chat_template.jinja`` or, without one, ``tokenizer_config.json``'s
``chat_template`` (transformers' precedence). It is untrusted code from a model directory, so it
runs in Jinja's immutable sandbox, with the environment transformers gives it: trimmed blocks,
loop controls, the ``{% generation %}`` tag (a no-op here: no assistant masks are asked for),
a ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``, the tokenizer's
special tokens as variables, ``tools`` and ``documents`` (None), and reasoning fields aliased
as transformers aliases them. The rendered text is then tokenized without adding special
tokens (the template wrote them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.openai.control_text import template_roles

_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers fills `reasoning_content` (and `thinking`, for gpt-oss templates) from these.
# Brackets a message's index in place of its content (a private-use character: never text
# a template writes), to find where each content lands in the rendered prompt.
_MARK = "\ue000"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that fails on these messages: the client's 400 (field ``messages``)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it
    (for training masks); rendering it is just its body."""

    tags = {"generation"}  # noqa: RUF012  (jinja2.ext.Extension declares a set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _Generation],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = env.from_string(source)
        self.roles = template_roles(source)  # what a message's role may be

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model directory's template, or None when it has none."""
        path = Path(model_dir)
        config_path = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        jinja_path = path / "chat_template.jinja"
        source: Any = jinja_path.read_text() if jinja_path.is_file() else None
        if not source:  # transformers: the .jinja file takes priority
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates: the default one
                default = (t.get("template") for t in source if t.get("name") == "default")
                source = next(default, None)
        if not isinstance(source, str) or not source:
            return None
        special: dict[str, Any] = {}
        for name in _SPECIAL:
            value = config.get(name)
            text = value.get("content") if isinstance(value, dict) else value
            if isinstance(text, str):
                special[name] = text
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [
                t.get("content") if isinstance(t, dict) else t for t in extra
            ]
        return cls(source, special)

    def render_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[tuple[str, bool]] | None:
        """The prompt as (text, is_message_content) parts, in order, or None when the
        template does not copy each message's content verbatim (it trims or rewrites it), so
        the contents cannot be told apart from the template's own text. Their concatenation
        is exactly ``render``'s text."""
        whole = self.render(messages, add_generation_prompt, tools)
        marked = [dict(m) for m in messages]
        contents: list[str] = []
        for message in marked:
            content = message.get("content")
            if isinstance(content, str):
                if _MARK in content:
                    return None
                message["content"] = f"{_MARK}{len(contents)}{_MARK}"
                contents.append(content)
        pieces = self.render(marked, add_generation_prompt, tools).split(_MARK)
        parts: list[tuple[str, bool]] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                parts.append((piece, False))
            elif not piece.isdigit() or int(piece) >= len(contents):
                return None  # the template cut a marker apart: not verbatim
            else:
                parts.append((contents[int(piece)], True))
        if len(pieces) % 2 == 0 or "".join(text for text, _ in parts) != whole:
            return None
        return [(text, is_content) for text, is_content in parts if text]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text. Messages are plain dicts (None values dropped, as transformers
        does); ``tools``: the request's, as OpenAI sends them (transformers passes them so).
        Raises ``ChatTemplateError`` when the template refuses them."""
        plain = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        try:
            return self._template.render(
                messages=plain,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template refused them: {exc}") from None
