"""Prompt logprobs (native_engine/prompt_logprobs.py) equal HF transformers' log-softmax over the
prompt within 1e-4, whether the prefill runs whole or in chunks, with a prefix-cache hit
available (it is not taken) or after one, and cost nothing when not asked for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from native_engine import LLM
from tests.engine.hf_reference import hf_logits, load_hf

PROMPT = [(37 * i + 11) % 1000 + 3 for i in range(45)]


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_are_hfs(chunk: int, llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(llama_dir, max_num_batched_tokens=chunk, block_size=16)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    (first,) = llm.generate([PROMPT], params)
    (again,) = llm.generate([PROMPT], params)  # its blocks are cached now: not used
    want = torch.log_softmax(hf_logits(load_hf(llama_dir), PROMPT).float(), dim=-1)
    for out in (first, again):
        assert [e.token_id for e in out.prompt_logprobs] == PROMPT[1:]
        got = torch.tensor([e.logprob for e in out.prompt_logprobs])
        expected = want[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
        assert torch.allclose(got, expected, atol=1e-4)
        top = want[: len(PROMPT) - 1].topk(3, dim=-1)
        got_top = torch.tensor([e.top_logprobs for e in out.prompt_logprobs])
        assert torch.allclose(got_top, top.values, atol=1e-4)
    assert again.num_cached_tokens == 0
    (plain,) = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.prompt_logprobs == [] and plain.num_cached_tokens > 0
    assert plain.token_ids == first.token_ids


def test_a_continuation_computes_none(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(llama_dir)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0)
    engine = llm.engine
    rid = engine.add_request(PROMPT, params, num_generated_tokens=2)
    updates = []
    while engine.has_unfinished_requests():
        updates += engine.step()
    assert updates and all(u.prompt_logprobs == [] for u in updates)
    assert rid
