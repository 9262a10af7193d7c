"""Speculative decoding changes speed, never output: with speculation on (n-gram and draft
model, k of 1 and 4) every request gives the tokens, text, finish reason and logprobs plain
decoding gives, greedy and seeded, and every block (target and draft) comes back."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import RequestOutput, SamplingParams
from engine.block_hash import hash_blocks
from native_engine import LLM
from tests.identical import compare_outputs

_RNG = random.Random(7)
PROMPTS = [
    [_RNG.randrange(1024) for _ in range(n)] for n in (3, 17, 40)
] + [[11, 12, 13, 14, 15] * 6, [5] * 9]  # fmt: skip
PROMPTS += [[21, 22, 23, 24] * 5, [_RNG.randrange(1024) for _ in range(12)]]  # penalized
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=12, ignore_eos=True),
    SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),  # never speculates
    # Each verified row counts the guesses before it as output (native_engine/model_runner.py).
    SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.4
    ),
    SamplingParams(
        max_tokens=24, temperature=0.8, seed=13, ignore_eos=True, repetition_penalty=1.5
    ),
]
# (method, which draft): the target as its own draft accepts nearly all; another random
# checkpoint of the same vocabulary rejects nearly all.
METHODS = [("ngram", None), ("draft", "self"), ("draft", "other")]


def _spec_kwargs(method: str, draft: str | None, target: Path, other: Path, k: int) -> dict:
    kwargs: dict[str, object] = {"speculative_method": method, "num_speculative_tokens": k}
    if draft is not None:
        kwargs["spec_draft_model"] = str(target if draft == "self" else other)
    return kwargs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(("method", "draft"), METHODS)
@pytest.mark.parametrize("k", [1, 4])
def test_speculation_gives_plain_decodings_tokens(
    arch: str,
    method: str,
    draft: str | None,
    k: int,
    model_factory: Callable[..., Path],
    make_llm: Callable[..., LLM],
) -> None:
    target, other = model_factory(arch), model_factory(arch, seed=1)
    plain = make_llm(target)
    references = plain.generate(PROMPTS, PARAMS)
    spec = make_llm(target, **_spec_kwargs(method, draft, target, other, k))
    outputs = spec.generate(PROMPTS, PARAMS)
    reports = compare_outputs(plain, outputs, references, PARAMS)
    assert len(reports) <= 1, reports  # a near-tie is possible, not a habit
    stats = spec.engine.stats()
    assert stats.num_spec_proposed_tokens > 0
    if draft == "self":  # the same model guesses: nearly every guess kept
        assert stats.num_spec_accepted_tokens >= 0.8 * stats.num_spec_proposed_tokens
        assert stats.num_steps < plain.engine.stats().num_steps
    if draft is not None:  # the draft ran each prompt it guessed for (not max_tokens=1's)
        guessed = sum(len(p) for p, s in zip(PROMPTS, PARAMS, strict=True) if s.max_tokens > 1)
        assert stats.num_draft_prompt_tokens_computed == guessed
    assert stats.num_prompt_tokens_computed == plain.engine.stats().num_prompt_tokens_computed


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """A stop string, a stop id and max_tokens reached by a run of several accepted tokens."""
    plain = make_llm(llama_dir)
    prompt = PROMPTS[2]
    free = plain.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    stop_text = plain.engine.tokenizer.decode(free.token_ids[13:15]).strip()
    assert stop_text, "the reference output must have text to stop at"
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[free.token_ids[11]]),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.7, seed=5, stop=[stop_text]),
    ]
    references = plain.generate([prompt] * 4, params)
    assert references[0].finish_reason == references[1].finish_reason == "stop"
    for k in (1, 4):
        spec = make_llm(
            llama_dir, speculative_method="draft", num_speculative_tokens=k,
            spec_draft_model=str(llama_dir),
        )  # fmt: skip
        outputs = spec.generate([prompt] * 4, params)
        assert not compare_outputs(plain, outputs, references, params)
        stats = spec.engine.stats()
        # Runs of accepted tokens, so the stops fall inside them.
        assert stats.num_spec_accepted_tokens > (stats.num_spec_verifications if k > 1 else 0)
        # Guesses kept past a stop are not output, so not counted as accepted: one request at
        # a time, each step outputs one token of its own plus the accepted guesses it used.
        for p in params:
            before = spec.engine.stats()
            out = spec.generate([prompt], p)[0]
            after = spec.engine.stats()
            num_steps = after.num_steps - before.num_steps
            num_accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
            assert len(out.token_ids) == num_steps + num_accepted, (p, k)


def test_a_self_draft_decodes_in_fewer_steps_than_tokens(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(
        llama_dir, speculative_method="draft", num_speculative_tokens=4,
        spec_draft_model=str(llama_dir),
    )  # fmt: skip
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=60, temperature=0.0))[0]
    stats = llm.engine.stats()
    assert stats.num_spec_accepted_tokens > 0.5 * stats.num_spec_proposed_tokens
    assert stats.num_steps < len(out.token_ids) / 2


def test_rejections_and_preemption_leak_no_block(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM]
) -> None:
    """A cache too small for the batch (preemption with guesses in the step) and a draft that
    is wrong most of the time (rollback after nearly every step): same tokens, no leak."""
    target, other = model_factory("llama"), model_factory("llama", seed=1)
    prompts = [[_RNG.randrange(1024) for _ in range(20)] for _ in range(6)]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True),
    ] * 3
    references = make_llm(target).generate(prompts, params)
    for draft in (target, other):
        spec = make_llm(
            target, num_blocks=14, block_size=8, speculative_method="draft",
            num_speculative_tokens=4, spec_draft_model=str(draft),
        )  # fmt: skip
        outputs = spec.generate(prompts, params)
        assert not compare_outputs(spec, outputs, references, params)
        stats = spec.engine.stats()
        assert stats.num_preemptions > 0
        if draft == other:  # rejected, rolled back
            assert stats.num_spec_proposed_tokens > stats.num_spec_accepted_tokens
        else:  # accepted runs in flight when the cache ran out
            assert stats.num_spec_accepted_tokens > 0


def test_the_prefix_cache_only_ever_holds_accepted_tokens(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM]
) -> None:
    target, other = model_factory("llama"), model_factory("llama", seed=1)
    spec = make_llm(
        target, block_size=4, speculative_method="draft", num_speculative_tokens=4,
        spec_draft_model=str(other),
    )  # fmt: skip
    prompts = [PROMPTS[1], PROMPTS[2]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outputs = spec.generate(prompts, params)
    engine = spec.engine
    assert engine.stats().num_spec_proposed_tokens > engine.stats().num_spec_accepted_tokens
    expected = set()
    for out in outputs:
        tokens = out.prompt_token_ids + out.token_ids
        expected.update(hash_blocks(engine.loaded.root_hash, tokens, engine.block_size))
    assert set(engine.block_manager.cached_hashes()) <= expected
    # And what those blocks hold is right: a prompt that hits them continues like plain.
    followups = [out.prompt_token_ids + out.token_ids[:-1] for out in outputs]
    again = spec.generate(followups, params)
    assert all(o.num_cached_tokens > 0 for o in again)
    references = make_llm(target, enable_prefix_caching=False).generate(followups, params)
    assert not compare_outputs(spec, again, references, [params] * 2)


def test_adaptivity_stops_guessing_for_a_request_whose_guesses_fail(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM]
) -> None:
    target, other = model_factory("llama"), model_factory("llama", seed=1)
    spec = make_llm(
        target, speculative_method="draft", num_speculative_tokens=4,
        spec_draft_model=str(other),
    )  # fmt: skip
    spec.generate([PROMPTS[1]], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    stats = spec.engine.stats()
    # Rejected guesses push the request into doubling sit-outs: far fewer verifying steps
    # than decoding steps (59 without adaptivity).
    assert stats.num_spec_verifications < 20


def test_a_batch_larger_than_max_batch_size_does_not_speculate(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(
        llama_dir, speculative_method="draft", num_speculative_tokens=2,
        spec_draft_model=str(llama_dir), spec_max_batch_size=2,
    )  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:3], params)
    assert llm.engine.stats().num_spec_proposed_tokens == 0
    llm.generate(PROMPTS[:2], params)
    assert llm.engine.stats().num_spec_proposed_tokens > 0


def test_abort_pause_and_max_model_len_mid_run(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM]
) -> None:
    """A request aborted while it speculates, one paused and resumed, and one that
    max_model_len ends inside an accepted run: the others give plain decoding's tokens, and
    neither the target's nor the draft's cache keeps a block (``make_llm`` checks both)."""
    target = model_factory("llama")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[2]]  # 17 + 40 tokens fit 64; 40 + 40 do not
    references = make_llm(target, max_model_len=64).generate(prompts, params)
    assert len(prompts[1]) + len(references[1].token_ids) == 64
    llm = make_llm(
        target, max_model_len=64, speculative_method="draft", num_speculative_tokens=4,
        spec_draft_model=str(target),
    )  # fmt: skip
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    victim = engine.add_request(PROMPTS[3], params)
    outputs = {i: RequestOutput(i, p) for i, p in zip(ids, prompts, strict=True)}
    for step in range(6):
        for update in engine.step():
            if update.request_id in outputs:
                outputs[update.request_id].apply(update)
        if step == 2:
            assert engine.abort(victim)
            assert engine.pause(ids[0])
        if step == 4:
            engine.resume(ids[0])
    while engine.has_unfinished_requests():
        for update in engine.step():
            outputs[update.request_id].apply(update)
    assert engine.stats().num_spec_accepted_tokens > 0
    assert not compare_outputs(llm, [outputs[i] for i in ids], references, [params] * 2)
