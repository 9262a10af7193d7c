"""The OpenAI API with the official ``openai`` client, against a real local cluster: chat and
text completions, streamed and not, give exactly what one engine gives on the same prompt
(the chat one templated by transformers' ``apply_chat_template``), greedy and seeded."""

from __future__ import annotations

import dataclasses
import http.client
import json
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from transformers import AutoTokenizer

from app.local_cluster import LocalCluster
from engine import SamplingParams
from native_engine import LLM
from native_engine.diagnostics import NEAR_TIE, first_difference, sampler_choice
from router.openai.bad_words import bad_words_ids
from tests.openai.conftest import API_KEY, MODEL_NAME

pytestmark = pytest.mark.slow
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
GREEDY: dict[str, Any] = {"temperature": 0.0}
# Not float32 values: the engine must sample with exactly these (doubles end to end).
SEEDED: dict[str, Any] = {"temperature": 0.83718291, "top_p": 0.91372405, "seed": 7}


@pytest.fixture(scope="module")
def client(http_cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_cluster.http_url}/v1", api_key=API_KEY, max_retries=0)


def templated(model_dir: Path) -> list[int]:
    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def params_of(sampling: dict[str, Any], max_tokens: int, seed_offset: int = 0) -> SamplingParams:
    seed = sampling.get("seed")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling["temperature"],
        top_p=sampling.get("top_p", 1.0),
        seed=seed + seed_offset if seed is not None else None,
    )


def assert_same(
    llm: LLM, prompt: list[int], token_ids: list[int], text: str, params: SamplingParams
) -> None:
    """The HTTP output is the engine's; a first difference at a logit near-tie of the
    reference's own choice is reported (a warning), never hidden as a pass otherwise."""
    (ref,) = llm.generate([prompt], params)
    if token_ids == ref.token_ids:
        assert text == ref.text
        return
    at = first_difference(token_ids, ref.token_ids)
    margin = sampler_choice(llm.engine, prompt, ref.token_ids, at, params).margin
    assert margin <= NEAR_TIE, f"differs at output {at} (margin {margin:.3g})"
    warnings.warn(f"near-tie at output {at} (margin {margin:.2g}), not a bug", stacklevel=2)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_are_one_engines_output(
    client: openai.OpenAI,
    reference: LLM,
    llama_dir: Path,
    sampling: dict[str, Any],
    stream: bool,
) -> None:
    prompt = templated(llama_dir)
    extra = {"return_token_ids": True}
    if not stream:
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, extra_body=extra, **sampling
        )
        assert r.model_extra is not None and r.model_extra["prompt_token_ids"] == prompt
        choice = r.choices[0]
        text, ids = choice.message.content or "", choice.model_extra["token_ids"]  # type: ignore[index]
        assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len(ids)
    else:
        chunks = list(
            client.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
                **sampling,
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].model_extra is not None
        assert chunks[0].model_extra["prompt_token_ids"] == prompt
        body = [c for c in chunks if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in body)
        ids = [t for c in body for t in c.choices[0].model_extra["token_ids"]]  # type: ignore[index]
        usage = chunks[-1].usage
        assert not chunks[-1].choices and usage is not None  # the include_usage chunk
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(ids))
        assert usage.total_tokens == len(prompt) + len(ids)
        assert all(c.usage is None for c in chunks[:-1])
        assert body[-1].choices[0].finish_reason in ("stop", "length")
    assert_same(reference, prompt, ids, text, params_of(sampling, 12))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_completions_of_text_and_token_ids(
    client: openai.OpenAI, reference: LLM, stream: bool
) -> None:
    prompts: list[Any] = ["The weather today", [5, 17, 200, 33, 9]]
    for prompt in prompts:
        r: Any = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=10,
            stream=stream,
            extra_body={"return_token_ids": True},
            **SEEDED,
        )
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"] if c.choices]
        prompt_ids = chunks[0].choices[0].model_extra["prompt_token_ids"]
        if isinstance(prompt, list):
            assert prompt_ids == prompt
        else:  # the router tokenized it as the engine does
            assert prompt_ids == reference.engine.tokenizer.encode(prompt)
        assert_same(reference, prompt_ids, ids, text, params_of(SEEDED, 10))


BAD_WORDS = ["the", "ing", "and so"]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_penalties_bias_and_min_tokens_are_the_engines(
    client: openai.OpenAI, reference: LLM, sampling: dict[str, Any]
) -> None:
    """Through the router, prefilled on one worker and decoded on another (the first token
    from prefill: the decode worker counts it as output)."""
    processing = {"presence_penalty": 0.6, "frequency_penalty": 1.1, "logit_bias": {"17": 3.0}}
    prompt = [5, 17, 200, 33, 9, 17, 17]
    r: Any = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=16,
        extra_body={
            "return_token_ids": True,
            "repetition_penalty": 1.4,
            "min_tokens": 16,
            "bad_words": BAD_WORDS,
        },
        **processing,
        **sampling,
    )
    ids = r.choices[0].model_extra["token_ids"]
    params = dataclasses.replace(
        params_of(sampling, 16),
        presence_penalty=0.6,
        frequency_penalty=1.1,
        repetition_penalty=1.4,
        logit_bias={17: 3.0},
        min_tokens=16,
        bad_words=bad_words_ids(BAD_WORDS, reference.engine.tokenizer),
    )
    assert_same(reference, prompt, ids, r.choices[0].text, params)


def test_n_choices_with_a_seed_are_reproducible_and_use_seed_plus_i(
    client: openai.OpenAI, reference: LLM
) -> None:
    prompt = [40, 41, 42, 43]

    def ask() -> list[list[int]]:
        extra = {"return_token_ids": True}
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, n=2, extra_body=extra, **SEEDED
        )
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage is not None and r.usage.prompt_tokens == len(prompt)  # counted once
        assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)  # type: ignore[index]
        return [c.model_extra["token_ids"] for c in r.choices]  # type: ignore[index]

    first, again = ask(), ask()
    assert first == again
    assert first[0] != first[1]  # independent choices (different seeds)
    for i, ids in enumerate(first):
        (ref,) = reference.generate([prompt], params_of(SEEDED, 8, seed_offset=i))
        assert ids == ref.token_ids


def test_streamed_choices_of_several_prompts_merge_and_count(
    client: openai.OpenAI, reference: LLM
) -> None:
    prompts = [[40, 41, 42, 43], [50, 51, 52]]
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        max_tokens=6,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
        **SEEDED,
    )
    ids: dict[int, list[int]] = {i: [] for i in range(4)}
    finished = set()
    usage = None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
        for choice in chunk.choices:
            ids[choice.index].extend(choice.model_extra["token_ids"])  # type: ignore[index]
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3}
    for index, got in ids.items():  # choice index = prompt x n + i; choice i uses seed + i
        prompt, i = prompts[index // 2], index % 2
        (ref,) = reference.generate([prompt], params_of(SEEDED, 6, seed_offset=i))
        assert got == ref.token_ids, index
    assert usage is not None and usage.prompt_tokens == 4 + 3  # each prompt once
    assert usage.completion_tokens == sum(len(v) for v in ids.values())


def test_logprobs_are_the_engines(client: openai.OpenAI, reference: LLM, llama_dir: Path) -> None:
    prompt = templated(llama_dir)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    (ref,) = reference.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
    assert len(content) == len(ref.logprobs)
    tokenizer = reference.engine.tokenizer
    assert tokenizer is not None
    for got, want in zip(content, ref.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, rel=1e-6, abs=1e-6)
        assert got.token == tokenizer.decode([want.token_id], skip_special_tokens=False)
        assert got.bytes == list(got.token.encode())
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(list(want.top_logprobs))
    text_r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, logprobs=2, **GREEDY
    )
    legacy = text_r.choices[0].logprobs
    assert legacy is not None and legacy.token_logprobs is not None
    assert legacy.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs])
    assert legacy.text_offset is not None and legacy.tokens is not None
    starts = [sum(len(t) for t in legacy.tokens[:i]) for i in range(len(legacy.tokens))]
    assert legacy.text_offset == starts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_and_prompt_logprobs_are_the_prefill_workers(
    client: openai.OpenAI, reference: LLM, stream: bool
) -> None:
    """echo + logprobs (lm-eval's loglikelihood request) and vLLM's prompt_logprobs: the
    prompt leads the text and the logprobs list, its entries the engine's own."""
    prompt = [5, 17, 200, 33, 9, 41]
    r: Any = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=3,
        logprobs=2,
        echo=True,
        stream=stream,
        extra_body={"prompt_logprobs": 1},
        **GREEDY,
    )
    chunks = list(r) if stream else [r]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2)
    (ref,) = reference.generate([prompt], params)
    tokenizer = reference.engine.tokenizer
    assert tokenizer is not None
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(prompt, skip_special_tokens=False) + ref.text
    token_logprobs = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert token_logprobs[0] is None
    want = [e.logprob for e in ref.prompt_logprobs] + [e.logprob for e in ref.logprobs]
    assert token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    (vllm_style,) = [c.choices[0].model_extra["prompt_logprobs"] for c in chunks[:1]]
    assert vllm_style[0] is None and len(vllm_style) == len(prompt)
    for entry, e in zip(vllm_style[1:], ref.prompt_logprobs, strict=True):
        assert entry[str(e.token_id)]["logprob"] == pytest.approx(e.logprob, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_choice_carries_its_prompts_logprobs_computed_once(
    client: openai.OpenAI, reference: LLM, http_cluster: LocalCluster, stream: bool
) -> None:
    """n choices of two prompts with echo + logprobs: the prompt's first choice alone asks a
    worker for its logprobs, and every choice's echo carries them, the engine's own."""
    prompts = [[5, 17, 200, 33, 9, 41], [8, 9, 10, 11]]
    r: Any = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        n=3,
        max_tokens=2,
        logprobs=1,
        echo=True,
        stream=stream,
        **GREEDY,
    )
    chunks = list(r) if stream else [r]
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=1)
    refs = reference.generate(prompts, params)
    leads: dict[int, list[float | None]] = {}
    for c in chunks:
        for choice in c.choices:
            if choice.index not in leads and choice.logprobs is not None:
                leads[choice.index] = list(choice.logprobs.token_logprobs)
    assert sorted(leads) == list(range(6))
    for index, got in leads.items():
        ref = refs[index // 3]
        assert got[0] is None
        want = [e.logprob for e in ref.prompt_logprobs]
        assert got[1 : len(want) + 1] == pytest.approx(want, abs=1e-5), index


def test_stop_strings_cut_the_text_as_the_engine_does(
    client: openai.OpenAI, reference: LLM
) -> None:
    prompt = [7, 8, 9, 10, 11]
    (free,) = reference.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip(), free.text
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=16, stop=[stop], **GREEDY
    )
    (ref,) = reference.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop])
    )
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "stop" == ref.finish_reason


def test_models_list_names_the_served_model(
    client: openai.OpenAI, http_cluster: LocalCluster
) -> None:
    (card,) = client.models.list().data
    assert card.id == MODEL_NAME and card.owned_by == "pdserve"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"not-an-id": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 99}, "logprobs"),
    ],
)
def test_a_bad_parameter_is_a_bad_request_naming_it(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="hi", **kwargs)
    body: Any = err.value.body
    assert body["param"] == param and param in body["message"], body


def test_an_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert "gpt-4" in str(err.value) and MODEL_NAME in str(err.value)


def test_a_wrong_key_is_refused(http_cluster: LocalCluster) -> None:
    bad = openai.OpenAI(base_url=f"{http_cluster.http_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_a_refusal_that_leaves_the_body_unread_says_it_closes_the_connection(
    http_cluster: LocalCluster,
) -> None:
    """The key is checked before the body is read, so the server closes the connection after a
    refused POST: the response says so, or a client that reuses the connection has its next
    request reset (the openai client's, above, was now and then). A refused GET (no body)
    keeps the connection."""
    url = urlsplit(http_cluster.http_url)
    assert url.hostname is not None and url.port is not None
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    wrong = {"Authorization": "Bearer sk-wrong", "Content-Type": "application/json"}
    try:
        body = json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2})
        conn.request("POST", "/v1/chat/completions", body, wrong)
        refused = conn.getresponse()
        refused.read()
        assert refused.status == 401 and refused.getheader("connection") == "close"
        conn.close()
        conn.request("GET", "/v1/models", headers=wrong)
        kept = conn.getresponse()
        kept.read()
        assert kept.status == 401 and kept.getheader("connection") != "close"
    finally:
        conn.close()
