"""A request's structured-output constraint: what its output must match (a JSON schema, any
JSON object, a regular expression, one of a list of strings), validated on construction.

The router builds it from the OpenAI fields (``response_format``, vLLM's ``guided_*`` and
``structured_outputs``); it travels in ``SamplingParams`` to every worker that samples for the
request, where ``engine/guide.py`` compiles it once (a bounded cache) into the token masks the
sampler applies. Limits are checked here, before anything is compiled, and each refusal names
the field and the limit.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

MAX_SPEC_BYTES = 32 * 1024  # a schema, regex or choice list, as text
MAX_SCHEMA_DEPTH = 32  # nesting of objects and arrays in a schema
MAX_CHOICES = 256
# A schema that asks for JSON: any object (``response_format: {"type": "json_object"}``).
ANY_OBJECT = '{"type": "object"}'
# JSON is written as ``json.dumps`` writes it (", " and ": " between items and keys, no other
# whitespace): free whitespace lets a weak model fill max_tokens with blanks.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    JSON_OBJECT = "json_object"  # spec: empty (any JSON object)
    REGEX = "regex"  # spec: the regular expression (Rust regex syntax, anchored)
    CHOICE = "choice"  # spec: a JSON list of strings, exactly one of which is the output


@dataclass(frozen=True)
class StructuredOutput:
    kind: StructuredKind
    spec: str = ""
    # The request field it came from, for refusals ("response_format", "guided_regex", ...).
    field: str = "response_format"

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StructuredKind):
            raise ValueError(f"{self.field}: unknown kind {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"{self.field} must be text, got {type(self.spec).__name__}")
        size = len(self.spec.encode())
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"{self.field} is {size} bytes, more than {MAX_SPEC_BYTES}")
        if self.kind is StructuredKind.JSON_SCHEMA:
            _check_schema(self.field, self.spec)
        elif self.kind is StructuredKind.REGEX:
            if not self.spec:
                raise ValueError(f"{self.field}: the regular expression is empty")
        elif self.kind is StructuredKind.CHOICE:
            _check_choices(self.field, self.spec)

    @classmethod
    def choice(cls, choices: list[str], field: str = "guided_choice") -> StructuredOutput:
        return cls(StructuredKind.CHOICE, json.dumps(choices), field)

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (its JSON form). Cheap and pure; whether
        the grammar compiles is ``engine/guide.py``'s to find out."""
        import llguidance

        matcher = llguidance.LLMatcher
        if self.kind is StructuredKind.JSON_SCHEMA:
            return matcher.grammar_from_json_schema(self.spec, _JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind is StructuredKind.JSON_OBJECT:
            return matcher.grammar_from_json_schema(ANY_OBJECT, _JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind is StructuredKind.REGEX:
            return matcher.grammar_from_regex(self.spec)
        # Lark string literals take JSON's escapes.
        alternatives = " | ".join(json.dumps(c) for c in json.loads(self.spec))
        return matcher.grammar_from_lark(f"start: {alternatives}")


def _check_schema(field: str, text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: the schema is not valid JSON ({e.msg})") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{field}: the schema must be a JSON object")
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{field}: the schema nests {depth} deep, more than {MAX_SCHEMA_DEPTH}")


def json_depth(value: object, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """Nesting depth of parsed JSON (objects and arrays), iteratively: hostile input must not
    exhaust the stack; counting stops once past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _check_choices(field: str, text: str) -> None:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices:
        raise ValueError(f"{field} must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"{field} has {len(choices)} choices, more than {MAX_CHOICES}")
    if any(not isinstance(c, str) or not c for c in choices):
        raise ValueError(f"{field} must be a list of non-empty strings")
