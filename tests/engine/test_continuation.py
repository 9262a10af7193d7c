"""A continued (migrated) request: an engine given the prompt plus k tokens already generated
(``num_generated_tokens=k``) produces exactly the rest of what one uninterrupted engine
produces, greedy and seeded; max_tokens, stop strings spanning the handover, logprobs and the
disaggregated path all continue."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.outputs import RequestOutput
from engine.structured_output import StructuredKind, StructuredOutput
from native_engine import LLM
from native_engine.llm_engine import LLMEngine
from tests.engine.test_disaggregation_hooks import _decode

BAD = [[t] for t in range(3, 300, 7)] + [[a, a + 1] for a in range(20, 60)]
WORDS = StructuredOutput(StructuredKind.REGEX, "[a-z ,.]+", "guided_regex")
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=5, ignore_eos=True),
    # Penalties count the earlier output as output, not as prompt: carried explicitly.
    SamplingParams(
        max_tokens=24,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=0.7,
        frequency_penalty=0.9,
        repetition_penalty=1.3,
        logit_bias={7: 1.5},
    ),
    SamplingParams(max_tokens=24, temperature=0.9, seed=3, frequency_penalty=1.5, min_tokens=20),
    # The continuing engine replays the grammar over the earlier output.
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, structured=WORDS),
    SamplingParams(max_tokens=24, temperature=0.9, seed=4, ignore_eos=True, structured=WORDS),
    # A bad word's head may end the earlier output: it counts as output.
    SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True, bad_words=BAD),
]
PROMPT = list(range(20, 45))


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams, k: int) -> RequestOutput:
    request_id = engine.add_request(prompt, params, num_generated_tokens=k)
    out = RequestOutput(request_id, prompt)
    while not out.finish_reason:
        for update in engine.step():
            out.apply(update)
    return out


@pytest.mark.parametrize(
    "params",
    PARAMS,
    ids=[
        "greedy",
        "seeded-top-p",
        "seeded-top-k",
        "greedy-penalized",
        "seeded-penalized",
        "greedy-guided",
        "seeded-guided",
        "seeded-bad-words",
    ],
)
@pytest.mark.parametrize("k", [1, 7, 23])
def test_continuing_after_k_tokens_gives_the_rest_of_one_run(
    llama_dir: Path, make_llm: Callable[..., LLM], params: SamplingParams, k: int
) -> None:
    llm = make_llm(llama_dir)
    whole = llm.generate([PROMPT], params)[0]
    rest = _run(llm.engine, PROMPT + whole.token_ids[:k], params, k)
    assert rest.token_ids == whole.token_ids[k:]  # max_tokens counted the k it was given
    if params.logprobs is not None:
        assert [lp.token_id for lp in rest.logprobs] == whole.token_ids[k:]
        assert [lp.top_token_ids for lp in rest.logprobs] == [
            lp.top_token_ids for lp in whole.logprobs[k:]
        ]


def test_a_stop_string_spanning_the_handover_is_found(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir)
    probe = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0.0))[0]
    # A stop string made of the tail of token 10's text and the head of token 11's.
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    before = tokenizer.decode(probe.token_ids[:11])
    after = tokenizer.decode(probe.token_ids[:12])
    stop = before[-2:] + after[len(before) : len(before) + 2]
    assert len(stop) >= 3, (before, after)
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[stop])
    whole = llm.generate([PROMPT], params)[0]
    assert whole.finish_reason == "stop"
    k = len(whole.token_ids) - 1  # hand over right before the token that completes it
    rest = _run(llm.engine, PROMPT + whole.token_ids[:k], params, k)
    assert rest.token_ids == whole.token_ids[k:] and rest.finish_reason == "stop"


def test_prefill_a_continuation_on_a_and_decode_it_on_b(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    a, b = make_llm(llama_dir).engine, make_llm(llama_dir).engine
    params = PARAMS[4]  # seeded and penalized: the decode worker counts the handed-over output
    whole = make_llm(llama_dir).generate([PROMPT], params)[0]
    k = 9
    request_id = a.add_request(
        PROMPT + whole.token_ids[:k], params, prefill_only=True, num_generated_tokens=k
    )
    while request_id not in a.pinned:
        a.step()
    prefilled = a.export_prefilled(request_id)
    assert prefilled.num_generated_tokens == k
    assert prefilled.first_token_id == whole.token_ids[k]
    assert _decode(b, prefilled, a)[1:] == whole.token_ids[k + 1 :]


@pytest.mark.parametrize(
    ("k", "message"),
    [
        (-1, "num_generated_tokens must be >= 0"),
        (24, "must be < max_tokens"),
        (len(PROMPT), "must be <"),
    ],
)
def test_an_impossible_continuation_is_refused_by_name(
    llama_dir: Path, make_llm: Callable[..., LLM], k: int, message: str
) -> None:
    engine = make_llm(llama_dir).engine
    with pytest.raises(ValueError, match=message):
        engine.add_request(PROMPT, PARAMS[0], num_generated_tokens=k)


def test_the_near_tie_check_reproduces_the_sampler(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """At every checked position of a run, the diagnostic picks the token the run picked, with
    a positive margin, greedy and seeded: it measures the sampler's own decision."""
    from native_engine.diagnostics import sampler_choice

    llm = make_llm(llama_dir)
    for params in PARAMS:
        whole = llm.generate([PROMPT], params)[0]
        for index in (0, 5, 17, 23):
            choice = sampler_choice(llm.engine, PROMPT, whole.token_ids, index, params)
            assert choice.token_id == whole.token_ids[index] and choice.margin > 0
