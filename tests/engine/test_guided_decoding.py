"""Guided decoding (engine/guide.py) on the tiny models: the output matches its constraint,
speculation never changes a guided output (a guess outside
the grammar is rejected), and what cannot compile is refused by name before any token. A
continued request's replay: tests/engine/test_continuation.py; across P/D and kill -9:
tests/faults (``mixed_params``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.structured_output import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_BYTES,
    StructuredKind,
    StructuredOutput,
)
from native_engine import LLM
from tests.identical import compare_outputs

WORDS = StructuredOutput(StructuredKind.REGEX, "[a-z ,.]+", "guided_regex")
DIGITS = StructuredOutput(StructuredKind.REGEX, r"\d{3}-\d{4}", "guided_regex")
COLOURS = StructuredOutput.choice(["red", "green", "blue and grey"])
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
TINY_JSON = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
PROMPTS = [[(13 * i + 7 * j) % 900 + 3 for j in range(5 + 4 * i)] for i in range(6)]


def _params(so: StructuredOutput, seed: int | None, max_tokens: int = 40) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=so)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed, structured=so)


PARAMS = [
    _params(WORDS, None),
    _params(WORDS, 5),
    _params(DIGITS, None),
    _params(COLOURS, 6),
    _params(TINY_JSON, None, max_tokens=120),
    _params(TINY_JSON, 7, max_tokens=120),
]


@pytest.fixture
def llm(llama_dir: Path, make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(llama_dir)


def test_outputs_match_their_constraints(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, PARAMS)
    for out, params in zip(outputs, PARAMS, strict=True):
        so = params.structured
        assert so is not None
        if so.kind is StructuredKind.REGEX:
            assert re.fullmatch(so.spec, out.text), (so.spec, out.text)
        elif so.kind is StructuredKind.CHOICE:
            assert out.text in json.loads(so.spec) and out.finish_reason == "stop"
        elif out.finish_reason == "stop":  # a random model may not close it in time
            value = json.loads(out.text)
            assert set(value) == {"id", "ok"}
            assert isinstance(value["id"], int) and isinstance(value["ok"], bool)
    # A complete constraint ends the request: the closed ones stopped early.
    assert outputs[2].finish_reason == "stop" and outputs[2].text.count("-") == 1
    unguided = llm.generate(PROMPTS[:1], [SamplingParams(max_tokens=40, temperature=0.0)])
    assert unguided[0].token_ids != outputs[0].token_ids  # the mask did something


@pytest.mark.parametrize(("method", "k"), [("ngram", 3), ("draft", 4)])
def test_speculation_never_changes_a_guided_output(
    method: str, k: int, llama_dir: Path, llm: LLM, make_llm: Callable[..., LLM]
) -> None:
    kwargs: dict[str, object] = {"speculative_method": method, "num_speculative_tokens": k}
    if method == "draft":
        kwargs["spec_draft_model"] = str(llama_dir)  # guesses without the grammar
    spec = make_llm(llama_dir, **kwargs)
    prompts = [*PROMPTS, [11, 12, 13, 14] * 6]
    params = [*PARAMS, _params(WORDS, None)]
    references = llm.generate(prompts, params)
    outputs = spec.generate(prompts, params)
    assert len(compare_outputs(llm, outputs, references, params)) <= 1
    assert spec.engine.stats().num_spec_proposed_tokens > 0


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "objectx"}'), "cannot be compiled"),
        (StructuredOutput(StructuredKind.REGEX, "([a-z]", "guided_regex"), "guided_regex cannot"),
    ],
)
def test_what_cannot_compile_is_refused_by_name(
    llm: LLM, so: StructuredOutput, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], [SamplingParams(max_tokens=4, structured=so)])
    assert llm.engine.stats().num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        (StructuredKind.JSON_SCHEMA, "x" * (MAX_SPEC_BYTES + 1), f"more than {MAX_SPEC_BYTES}"),
        (StructuredKind.JSON_SCHEMA, "{not json", "not valid JSON"),
        (StructuredKind.JSON_SCHEMA, "[1]", "must be a JSON object"),
        (
            StructuredKind.JSON_SCHEMA,
            '{"items":' * (MAX_SCHEMA_DEPTH + 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH + 1),
            f"more than {MAX_SCHEMA_DEPTH}",
        ),
        (StructuredKind.REGEX, "", "empty"),
        (StructuredKind.CHOICE, "[]", "non-empty list"),
        (StructuredKind.CHOICE, json.dumps(["a"] * (MAX_CHOICES + 1)), f"more than {MAX_CHOICES}"),
    ],
)
def test_limits_are_checked_before_compiling(kind: StructuredKind, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        StructuredOutput(kind, spec, "response_format")
    assert str(e.value).startswith("response_format")


def test_masks_filled_together_are_each_guides_own(llm: LLM) -> None:
    """``next_masks`` (one call, llguidance's threads) gives every guide the row its own
    ``masks`` gives: grammars of every kind, at different positions, with ``ignore_eos``,
    and a guide left as it was (neither advances a matcher)."""
    from engine.guide import next_masks

    guides = llm.engine.loaded.guides
    specs = [WORDS, DIGITS, COLOURS, TINY_JSON, WORDS]
    for spec in specs:
        guides.compile(spec)
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    made = [
        guides.guide(WORDS, []),
        guides.guide(DIGITS, tokenizer.encode("12", add_special_tokens=False)),
        guides.guide(COLOURS, []),
        guides.guide(TINY_JSON, tokenizer.encode('{"id": 1', add_special_tokens=False)),
        guides.guide(WORDS, tokenizer.encode("a b", add_special_tokens=False), ignore_eos=True),
    ]
    one_by_one = [g.masks((), 1)[0] for g in made]
    together = next_masks(made)
    assert len(together) == len(made)
    for own, filled in zip(one_by_one, together, strict=True):
        assert torch.equal(own, filled)
    for g, own in zip(made, one_by_one, strict=True):  # neither moved a matcher
        assert torch.equal(g.masks((), 1)[0], own)
