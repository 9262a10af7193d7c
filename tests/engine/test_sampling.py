"""Sampling semantics through the whole engine: seeds, filters, stops, EOS, logprobs, errors."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from native_engine import LLM
from tests.engine.hf_reference import hf_logits, load_hf


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def test_seed_gives_same_tokens_regardless_of_batch(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir)
    prompt = _prompts(1)[0]
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = _prompts(6, seed=9)
    mixed_params = [
        SamplingParams(max_tokens=n, temperature=0.7, ignore_eos=True)
        for n in (3, 30, 5, 12, 24, 7)
    ]
    batch = llm.generate([*others, prompt], [*mixed_params, seeded])
    assert batch[-1].token_ids == alone
    other_seed = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=43, ignore_eos=True)
    )[0].token_ids
    assert other_seed != alone
    greedy = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )[0].token_ids
    assert greedy != alone  # temperature 1 on a random model really samples


@pytest.mark.parametrize(
    "filters",
    [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}],
    ids=["top_k=1", "top_p~0", "min_p=1"],
)
def test_filters_that_keep_one_token_equal_greedy(
    llama_dir: Path, make_llm: Callable[..., LLM], filters: dict
) -> None:
    llm = make_llm(llama_dir)
    prompts = _prompts(4)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    filtered = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True, **filters)
    )
    assert [o.token_ids for o in filtered] == [o.token_ids for o in greedy]


def test_top_k_restricts_samples_to_the_k_best(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir)
    hf = load_hf(llama_dir)
    prompt = _prompts(1, seed=11)[0]
    top3 = set(hf_logits(hf, prompt)[-1].topk(3).indices.tolist())
    params = [SamplingParams(max_tokens=1, temperature=5.0, top_k=3, seed=s) for s in range(40)]
    firsts = {o.token_ids[0] for o in llm.generate([prompt] * 40, params)}
    assert firsts <= top3 and len(firsts) > 1


def test_logprobs_match_hf_log_softmax(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(llama_dir)
    prompt = _prompts(1, seed=12)[0]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=5, ignore_eos=True)
    )[0]
    assert len(out.logprobs) == 3
    ref = torch.log_softmax(hf_logits(load_hf(llama_dir), prompt + out.token_ids[:2]), dim=-1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i] == lp.top_token_ids[0]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        values, ids = row.topk(5)
        assert list(lp.top_token_ids) == ids.tolist()
        assert list(lp.top_logprobs) == pytest.approx(values.tolist(), abs=1e-4)


def test_stop_token_ids_and_stop_strings(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(llama_dir)
    prompt = "The weather today"
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop_id = free.token_ids[6]
    first_index = free.token_ids.index(stop_id)
    by_id = llm.generate(
        [prompt],
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[: first_index + 1]
    # The stop token is returned, but its text is not (vLLM's default).
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    assert by_id.text == tokenizer.decode(by_id.token_ids[:-1])
    # A stop string taken from the middle of the free-running text.
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip()
    by_text = llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == free.text[: free.text.index(stop)]
    assert stop not in by_text.text


def test_eos_from_generation_config_stops_unless_ignored(
    llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    prompt = _prompts(1, seed=13)[0]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    free = make_llm(llama_dir).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )[0]
    eos = free.token_ids[4]
    model_dir = tmp_path / "eos-model"
    shutil.copytree(llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = make_llm(model_dir)
    assert eos in llm.engine.model_config.eos_token_ids
    stopped = llm.generate([prompt], params)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    ignored = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )[0]
    assert ignored.token_ids == free.token_ids


def test_text_prompt_and_text_output(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(llama_dir)
    out = llm.generate(["Héllo wörld — 🙂"], SamplingParams(max_tokens=16, temperature=0.0))[0]
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    assert out.prompt_token_ids == tokenizer.encode("Héllo wörld — 🙂")
    assert out.text == tokenizer.decode(out.token_ids)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([5, 10**6], SamplingParams(), "prompt_token_ids"),
        ([-1], SamplingParams(), "prompt_token_ids"),
        (list(range(3, 3 + 513)), SamplingParams(), "max_model_len"),
        ("", SamplingParams(), "prompt"),
    ],
)
def test_bad_prompts_name_the_field(
    llama_dir: Path,
    make_llm: Callable[..., LLM],
    prompt: object,
    params: SamplingParams,
    field: str,
) -> None:
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)  # type: ignore[list-item]
    assert not llm.engine.has_unfinished_requests()


def test_model_without_tokenizer_serves_token_ids(
    llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(llama_dir / name, bare / name)
    llm = make_llm(bare)
    with_tok = make_llm(llama_dir)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params)[0]
    assert out.token_ids == with_tok.generate([[5, 6, 7]], params)[0].token_ids
    assert out.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], params)
