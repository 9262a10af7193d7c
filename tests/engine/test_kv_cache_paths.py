"""The KV cache is exact: parallel prefill == token-by-token decode; prefix hits and preemption
change nothing but the work done."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from native_engine import LLM
from native_engine.paged_sequence import PagedSequence
from native_engine.scheduler import ScheduledSeq
from tests.engine.hf_reference import hf_logits, load_hf

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _run_chunks(llm: LLM, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, computing the sequence `chunk` tokens per step."""
    engine = llm.engine
    seq = PagedSequence("logits-probe", token_ids, SamplingParams())
    rows: list[torch.Tensor] = []
    while seq.num_computed_tokens < len(token_ids):
        n = min(chunk, len(token_ids) - seq.num_computed_tokens)
        assert engine.block_manager.allocate_slots(seq, n)
        _, logits = engine.runner.forward_logits([ScheduledSeq(seq, n)])
        rows.append(logits)
        seq.num_computed_tokens += n
    engine.block_manager.free(seq)
    return torch.cat(rows)  # [len, vocab]


def test_parallel_prefill_equals_token_by_token(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir, block_size=16)
    rng = random.Random(1)
    token_ids = [rng.randrange(3, 1000) for _ in range(45)]
    parallel = _run_chunks(llm, token_ids, chunk=len(token_ids))
    stepwise = _run_chunks(llm, token_ids, chunk=1)  # every step goes through paged decode
    chunked = _run_chunks(llm, token_ids, chunk=7)  # prefill with cached context
    torch.testing.assert_close(stepwise, parallel, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked, parallel, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        parallel, hf_logits(load_hf(llama_dir), token_ids), atol=1e-4, rtol=1e-4
    )


def test_prefix_cache_hit_reports_shared_blocks_and_keeps_outputs(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    rng = random.Random(2)
    shared = [rng.randrange(3, 1000) for _ in range(40)]  # 2 full blocks + 8 tokens
    first = [*shared, 11, 12, 13]
    second = [*shared, 21, 22]
    cached = make_llm(llama_dir, block_size=16)
    uncached = make_llm(llama_dir, block_size=16, enable_prefix_caching=False)
    out_first = cached.generate([first], GREEDY)[0]
    out_second = cached.generate([second], GREEDY)[0]
    assert out_first.num_cached_tokens == 0
    assert out_second.num_cached_tokens == 32
    ref = uncached.generate([first, second], GREEDY)
    assert [o.num_cached_tokens for o in ref] == [0, 0]
    assert out_first.token_ids == ref[0].token_ids
    assert out_second.token_ids == ref[1].token_ids
    # Same prompt again: all full blocks hit except that the last token is always recomputed.
    again = cached.generate([first], GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == out_first.token_ids
    stats = cached.engine.stats()
    assert stats.num_prefix_hit_tokens == 64


def test_preemption_under_tiny_cache_keeps_outputs(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (20, 31, 12, 40, 25, 9)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_llm(llama_dir, block_size=4)
    # 24 blocks of 4 tokens: the batch cannot all grow to ~80 tokens at once.
    tight = make_llm(llama_dir, block_size=4, num_blocks=24)
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_priority_preemption_keeps_every_output_the_unloaded_runs(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """The priority policy preempts the least urgent under KV pressure (recompute): every
    request's tokens, greedy and seeded, are what the roomy fcfs engine produced."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (20, 31, 12, 40, 25, 9)]
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            ignore_eos=True,
            priority=priority,
        )
        for i, priority in enumerate((5, 5, -1, 0, -1, 5))
    ]
    roomy = make_llm(llama_dir, block_size=4)
    tight = make_llm(llama_dir, block_size=4, num_blocks=24, scheduling_policy="priority")
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_request_larger_than_cache_finishes_instead_of_hanging(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir, block_size=4, num_blocks=4)  # 16 tokens in all
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert out.finish_reason == "length"
    # 16 cached tokens are enough to sample the 17th: 7 new tokens, then no block is left.
    assert len(out.token_ids) == 16 - 10 + 1


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_kernel_backends_in_the_engine_match_the_torch_path(
    llama_dir: Path, make_llm: Callable[..., LLM], backend: str
) -> None:
    """The engine wired to the Triton kernels (interpreted on CPU) or the native CPU kernel gives
    the torch path's tokens and logits."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 18)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fast = make_llm(llama_dir, attention_backend=backend, block_size=8)
    torch_path = make_llm(llama_dir, attention_backend="torch", block_size=8)
    assert fast.engine.loaded.attention_backend.value == backend
    got = fast.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in torch_path.generate(prompts, params)]
    token_ids = prompts[1] + got[1].token_ids
    torch.testing.assert_close(
        _run_chunks(fast, token_ids, chunk=1),
        _run_chunks(torch_path, token_ids, chunk=1),
        atol=1e-4,
        rtol=1e-4,
    )
