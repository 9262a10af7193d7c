"""A model's chat template, rendered as transformers' ``apply_chat_template`` renders it (the
router stays torch-free: Jinja only).

The template comes from ``tokenizer_config.json`` (``chat_template``) or ``chat_template.jinja``.
It is untrusted code from a model directory, so it runs in Jinja's immutable sandbox, with the
same environment transformers gives it: trimmed blocks, loop controls, a ``tojson`` that does
not escape HTML, ``raise_exception``, ``strftime_now``, and the tokenizer's special tokens as
variables. The rendered text is then tokenized without adding special tokens (the template
wrote them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


class ChatTemplateError(ValueError):
    """A template that fails on these messages: the client's 400 (field ``messages``)."""


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
    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = env.from_string(source)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model directory's template, or None when it has none."""
        path = Path(model_dir)
        config_path = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        jinja_path = path / "chat_template.jinja"
        if not source and jinja_path.is_file():
            source = jinja_path.read_text()
        if not isinstance(source, str) or not source:
            return None
        special = {}
        for name in _SPECIAL:
            value = config.get(name)
            text = value.get("content") if isinstance(value, dict) else value
            if isinstance(text, str):
                special[name] = text
        return cls(source, special)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text. Messages are plain dicts (None values dropped, as transformers
        does). Raises ``ChatTemplateError`` when the template refuses them."""
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template refused them: {exc}") from None
