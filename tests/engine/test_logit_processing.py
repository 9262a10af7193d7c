"""Logit processing before sampling (``engine/sampling.py`` ``processed_logits``): exact values
for each of min_tokens, logit_bias and the three penalties, HF's repetition penalty matched,
rows without any untouched, logprobs still of the raw logits, and the bad values refused by
name. Exactness across continuation (migration), P/D and speculation: the engine suites
(``test_continuation.py``, ``test_speculative.py``) run penalized requests too."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engine import SamplingParams
from engine.sampling import SampleRequest, processed_logits
from native_engine import LLM
from native_engine.sampler import Sampler

RAW = torch.tensor([[1.0, -2.0, 3.0, 0.5], [1.0, -2.0, 3.0, 0.5]])
NEG = float("-inf")


def test_each_processing_step_gives_its_exact_values() -> None:
    params = SamplingParams(
        max_tokens=8,
        min_tokens=5,
        logit_bias={1: 10.0},
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # Output so far [2, 2, 3] (index 3 < min_tokens 5: stop id 0 masked); prompt [0].
    processed = SampleRequest(params, 3, prompt_ids=[0], output_ids=[2, 2, 3], stop_ids=(0,))
    plain = SampleRequest(SamplingParams(max_tokens=8), 3)
    out = processed_logits(RAW, [processed, plain])
    # id 1: -2 + 10 (never seen). id 2: 3 / 2 - 0.5 x 2 - 0.25. id 3: 0.5 / 2 - 0.5 - 0.25.
    assert out[0].tolist() == [float("-inf"), 8.0, 0.25, -0.5]
    assert torch.equal(out[1], RAW[1])  # a row without processing is untouched
    assert processed_logits(RAW, [plain, plain]) is RAW  # and none at all: not even copied
    past = SampleRequest(params, 5, prompt_ids=[0], output_ids=[2, 2, 3, 1, 1], stop_ids=(0,))
    assert processed_logits(RAW, [past])[0, 0] == 1.0 / 2.0  # min_tokens reached: no mask


def test_repetition_penalty_matches_transformers() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    prompt, output = [3, 7, 7, 40], [9, 3, 12]
    params = SamplingParams(max_tokens=8, repetition_penalty=1.7)
    ours = processed_logits(logits, [SampleRequest(params, 3, prompt, output)] * 2)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output] * 2), logits.clone())
    assert torch.equal(ours, hf)


def test_the_choice_is_processed_and_the_logprobs_are_raw() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, logit_bias={1: 10.0})
    out = Sampler(torch.device("cpu"))(RAW[:1], [SampleRequest(params, 0)])
    assert out.token_ids == [1]  # the bias made it the argmax
    logprobs = out.logprobs[0]
    assert logprobs is not None
    assert logprobs.top_token_ids == (2,)  # of the model's own logits
    assert logprobs.logprob == pytest.approx(torch.log_softmax(RAW[0], -1)[1].item())


def test_penalties_change_a_greedy_run(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    """The repeating prompt a tiny model loops on: a strong frequency penalty breaks the loop."""
    llm = make_llm(llama_dir)
    prompt = [11, 12, 13] * 8
    plain = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    penalized = SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=2.0)
    out = llm.generate([prompt], penalized)[0]
    assert out.token_ids != plain.token_ids
    biased = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={42: 100.0})
    assert llm.generate([prompt], biased)[0].token_ids == [42] * 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
        ({"min_tokens": 9}, "min_tokens (9) must be <= max_tokens"),
        ({"logit_bias": {3: 101.0}}, "logit_bias[3] must be in"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be >= 0"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "more than 300"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(max_tokens=8, **kwargs)  # type: ignore[arg-type]


def test_a_bias_on_an_unknown_token_is_refused(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))


def test_bad_words_mask_the_last_token_where_the_output_ends_with_the_rest() -> None:
    params = SamplingParams(max_tokens=8, bad_words=[[3], [2, 1], [3, 0], [0, 2, 2]])
    request = SampleRequest(params, 3, prompt_ids=[0], output_ids=[2, 2])
    # [3]: always; [2, 1]: the output ends with 2; [3, 0]: it does not end with 3; [0, 2, 2]:
    # the prompt's 0 is not output.
    assert processed_logits(RAW[:1], [request])[0].tolist() == [1.0, float("-inf"), 3.0, NEG]


def test_bad_words_keep_a_greedy_run_off_them(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir)
    prompt = [5, 17, 200, 33, 9]
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    word = plain.token_ids[2:4]  # a two-token word the plain run writes at 2
    params = SamplingParams(max_tokens=12, temperature=0.0, bad_words=[word])
    (out,) = llm.generate([prompt], params)
    assert out.token_ids[:3] == plain.token_ids[:3] and out.token_ids[3] != word[1]
    assert all(out.token_ids[i : i + 2] != word for i in range(len(out.token_ids) - 1))
