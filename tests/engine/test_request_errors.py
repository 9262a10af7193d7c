"""A request whose own parameters leave it nowhere to go ends with its error, never the engine
(engine/request_error.py): a grammar whose allowed tokens its bad_words or min_tokens ban is
refused at admission when its first position allows nothing, and ends with finish reason
"error" (naming the fields) at the position where it runs out; the other requests of the same
batch give exactly their solo tokens, no block leaks, and the engine goes on. Ids outside the
vocabulary and bans covering it are refused by name before any work; a matcher past its lexer
budget fails its request instead of passing for complete. Through the public API, with worker
pids: tests/security/test_hostile_requests.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.guide import Guide
from engine.request_error import RequestError
from engine.request_state import RequestState
from engine.sequence import Sequence
from engine.structured_output import StructuredKind, StructuredOutput
from native_engine import LLM
from native_engine.async_engine import AsyncEngine
from native_engine.llm_engine import LLMEngine

SEVEN_EIGHT = StructuredOutput(StructuredKind.REGEX, "78", "guided_regex")
PROMPTS = [[5, 6, 7, 8], list(range(40, 60)), [9, 9, 9]]


@pytest.fixture
def llm(llama_dir: Path, make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(llama_dir)


def _token(llm: LLM, text: str) -> int:
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    (token_id,) = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def _plain(seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=12, temperature=0.8, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("seed", [None, 3])
def test_a_position_with_no_allowed_token_ends_that_request_only(
    llm: LLM, seed: int | None
) -> None:
    seven, eight = _token(llm, "7"), _token(llm, "8")
    # "7" is allowed; after it the grammar allows only "8", which bad_words bans there.
    impossible = dataclasses.replace(
        _plain(seed), structured=SEVEN_EIGHT, bad_words=[[seven, eight]]
    )
    others = [_plain(None), _plain(11)]
    solo = llm.generate(PROMPTS[1:], others)

    outs = llm.generate(PROMPTS, [impossible, *others])

    failed = outs[0]
    assert failed.finish_reason == "error"
    assert failed.error is not None
    assert "output index 1" in failed.error
    assert "guided_regex" in failed.error and "bad_words" in failed.error
    assert failed.token_ids == [seven]  # the token before the position that had none
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in solo]
    llm.engine.block_manager.check_no_leaks()
    # The engine goes on: the same batch again without the impossible request.
    assert [o.token_ids for o in llm.generate(PROMPTS[1:], others)] == [o.token_ids for o in solo]


def test_min_tokens_masking_the_only_token_the_grammar_allows_ends_the_request(llm: LLM) -> None:
    eight = _token(llm, "8")
    params = SamplingParams(
        max_tokens=8, temperature=0.0, structured=SEVEN_EIGHT, min_tokens=3, stop_token_ids=[eight]
    )
    (out,) = llm.generate([PROMPTS[0]], params)
    assert out.finish_reason == "error"
    assert out.error is not None and "min_tokens (3" in out.error and "guided_regex" in out.error


def test_a_first_position_with_no_allowed_token_is_refused_before_any_work(llm: LLM) -> None:
    seven = _token(llm, "7")
    so = StructuredOutput(StructuredKind.REGEX, "7", "guided_regex")
    params = SamplingParams(max_tokens=4, temperature=0.0, structured=so, bad_words=[[seven]])
    computed = llm.engine.num_prompt_tokens_computed
    with pytest.raises(ValueError, match=r"output index 0.*guided_regex.*bad_words"):
        llm.generate([PROMPTS[0]], params)
    assert llm.engine.num_prompt_tokens_computed == computed
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("bad_words", SamplingParams(max_tokens=2, bad_words=[[3, 4294967295]])),
        ("bad_words", SamplingParams(max_tokens=2, bad_words=[[1024]])),
        ("stop_token_ids", SamplingParams(max_tokens=2, stop_token_ids=[1 << 20])),
        ("logit_bias", SamplingParams(max_tokens=2, logit_bias={5000: 1.0})),
    ],
)
def test_ids_outside_the_vocabulary_are_refused_by_name(
    llm: LLM, field: str, params: SamplingParams
) -> None:
    with pytest.raises(ValueError, match=f"{field} has ids outside the vocabulary"):
        llm.generate([PROMPTS[0]], params)


def test_bans_that_could_cover_the_vocabulary_are_refused(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(vocab)))
    with pytest.raises(ValueError, match=f"could ban all {vocab} tokens"):
        llm.generate([PROMPTS[0]], params)
    # One token fewer leaves one: admitted, and it is what the request samples.
    left = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(1, vocab)))
    (out,) = llm.generate([PROMPTS[0]], left)
    assert out.token_ids[:2] == [0, 0]


def test_a_matcher_past_its_lexer_budget_fails_its_request_not_stops_it(llama_dir: Path) -> None:
    import llguidance

    tokenizer = llguidance.LLTokenizer(str(llama_dir / "tokenizer.json"), n_vocab=1024)
    schema = (
        '{"type": "object", "properties": {"a": {"type": "string", "pattern": "(x|y)*z(x|y){10}"}}}'
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    limits = llguidance.LLParserLimits(step_lexer_fuel=5)  # llguidance's own budget, tiny
    guide = Guide(
        llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits),
        1024,
        "response_format",
    )
    eos = tokenizer.eos_token
    first = int(guide.masks((), 1)[0].nonzero()[0])
    assert not guide.accept(first)
    allowed = guide.masks((), 1)[0]  # past the budget: llguidance allows only EOS
    assert allowed.nonzero().flatten().tolist() == [eos]
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=8), guide=guide)
    seq.token_ids.append(first)
    state = RequestState(seq, None)
    with pytest.raises(RequestError, match="response_format: the grammar's matcher failed"):
        state.append(eos, None, (eos,), 64)
    assert seq.token_ids == [1, 2, first]  # nothing appended: no "stop" on a cut-short output


def test_the_async_engine_raises_the_request_error_and_stays_alive(llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), cache=CacheConfig(num_blocks=64)))
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    seven, eight = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("7", "8"))
    impossible = SamplingParams(
        max_tokens=8, temperature=0.0, structured=SEVEN_EIGHT, bad_words=[[seven, eight]]
    )

    async def run() -> None:
        serving = AsyncEngine(engine)
        serving.start()
        try:
            with pytest.raises(RequestError, match="output index 1"):
                async for _ in serving.generate("bad", PROMPTS[0], impossible):
                    pass
            tokens = []
            async for update in serving.generate("good", PROMPTS[1], _plain(None)):
                tokens.extend(update.new_token_ids)
            assert len(tokens) == 12 and serving.error is None
        finally:
            await serving.close()
        engine.block_manager.check_no_leaks()

    asyncio.run(run())
