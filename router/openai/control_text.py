"""Client text a chat template writes outside a message's content must never become control
tokens.

A message's ``content`` holding a control-token string ("<|im_end|>") is tokenized as text
(``protocol.chat_prompt``). Everything else a client sends that the template may copy into the
prompt (a ``role``, a ``name``, tool calls and their arguments, a ``tool_call_id``, reasoning
fields, tool definitions) is rendered as the template's own text, where such a string would be
read as the marker itself and open a turn of another role: so it is refused, by name, before
rendering. A role must also be one the template can mean: OpenAI's roles, or one the template
names itself (``ipython``, say); any other is refused. Pure; called in the tokenization slot,
since a request's messages can be megabytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from engine.tokenizer import Tokenizer
from router.openai.invalid_parameter import InvalidParameter

OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_QUOTED_WORD = re.compile(r"""['"]([A-Za-z_][A-Za-z0-9_-]*)['"]""")


def template_roles(source: str) -> frozenset[str]:
    """The roles a template can mean: OpenAI's, and every quoted word it names (a template
    tests a role against a literal: ``message['role'] == 'ipython'``)."""
    return OPENAI_ROLES | frozenset(_QUOTED_WORD.findall(source))


def check_control_text(
    tokenizer: Tokenizer | None,
    roles: frozenset[str],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> None:
    """Raises ``InvalidParameter`` naming the field: a role the template does not know, or a
    control-token string anywhere a template copies client text verbatim but a content."""
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in roles:
            where = f"messages[{i}].role"
            known = ", ".join(sorted(OPENAI_ROLES))
            raise InvalidParameter(where, f"{where} {role!r} is not a role: use one of {known}")
    if tokenizer is None or not tokenizer.special_strings:
        return
    fields = [
        (f"messages[{i}].{key}", value)
        for i, message in enumerate(messages)
        for key, value in message.items()
        if key != "content"
    ]
    fields.append(("tools", tools))
    for where, value in fields:
        for path, text in _texts(value, where):
            special = tokenizer.has_special_string(text)
            if special is not None:
                raise InvalidParameter(
                    path,
                    f"{path} holds the control token {special!r}: only a message's content may "
                    "hold it (as text)",
                )


def _texts(value: object, where: str) -> Iterator[tuple[str, str]]:
    """Every string in ``value`` (keys too), with its path; iterative: the depth of what a
    client sends must not exhaust the stack."""
    stack: list[tuple[str, object]] = [(where, value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            yield path, node
        elif isinstance(node, dict):
            for key, child in node.items():
                if isinstance(key, str):
                    yield f"{path} (a key)", key
                stack.append((f"{path}.{key}", child))
        elif isinstance(node, list):
            stack.extend((f"{path}[{k}]", child) for k, child in enumerate(node))
