"""bf16 on AMX is batch- and chunk-invariant (docs/engine.md "Numerics"): a request's tokens
and logprobs are the same bits alone or among 56 others, whatever shares its steps (batches
past the GEMM's old switch point at 48 rows, steps mixing other prompts' prefills), however
its prompt is chunked, and with or without its prefix cached. Every bf16 GEMM row is pdserve's
AMX kernel's (the same sums at any M), a decode sequence's attention is split into fixed spans,
and a prompt row's attention is the AMX prefill kernel's (its own keys, in order)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from native_engine import LLM
from native_engine.kernels import small_gemm
from native_engine.kernels.small_gemm import GemmIsa

pytestmark = pytest.mark.skipif(
    small_gemm.chosen(torch.bfloat16) is not GemmIsa.AMX,
    reason="batch-invariant bf16 needs the AMX GEMM: elsewhere oneDNN's bf16 rows move with M",
)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_requests_bf16_tokens_do_not_depend_on_its_batch(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM], prefix_caching: bool
) -> None:
    model = model_factory("llama", "tiny64")
    # A budget of 512 tokens: each prompt is prefilled whole, some beside running decodes.
    llm = make_llm(
        model, dtype="bfloat16", max_num_batched_tokens=512, enable_prefix_caching=prefix_caching
    )
    rng = random.Random(3)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    probe = prompt(150)
    others = [prompt(n) for n in (12, 200, 75, 40, 130, 9, 61, 170) * 7]  # 56: past 48 rows
    for params in (
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(
            max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=3
        ),
    ):
        (alone,) = llm.generate([probe], params)
        crowd = llm.generate([*others[:20], probe, *others[20:]], params)
        assert crowd[20].token_ids == alone.token_ids
        # The same bits all the way: every logprob the model gave, not only the winners.
        assert crowd[20].logprobs == alone.logprobs


def test_a_prompts_bf16_results_do_not_depend_on_its_chunking(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM]
) -> None:
    model = model_factory("llama", "tiny64")
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(96)]
    probe = [*shared, *(rng.randrange(3, 250) for _ in range(110))]
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    # Whole: one 206-token chunk. Chunked: 40 tokens a step. Cached: the first 96 tokens come
    # from the prefix cache (another prompt left them), so the prefill starts at token 96.
    (whole,) = make_llm(model, dtype="bfloat16", max_num_batched_tokens=512).generate(
        [probe], params
    )
    (chunked,) = make_llm(model, dtype="bfloat16", max_num_batched_tokens=40).generate(
        [probe], params
    )
    cached_llm = make_llm(
        model, dtype="bfloat16", max_num_batched_tokens=512, enable_prefix_caching=True
    )
    cached_llm.generate([[*shared, 7, 8, 9]], SamplingParams(max_tokens=1))
    (cached,) = cached_llm.generate([probe], params)
    for other in (chunked, cached):
        assert other.token_ids == whole.token_ids
        assert other.logprobs == whole.logprobs
    # Prompt logprobs come from every prompt row: the cached rows are not recomputed there.
    assert chunked.prompt_logprobs == whole.prompt_logprobs
