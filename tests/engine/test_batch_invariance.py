"""bf16 decode on AMX is batch-invariant (docs/engine.md "Numerics"): a request's tokens are the
same alone or among 56 others, whatever shares its decode steps (batches past the GEMM's old
switch point at 48 rows, steps mixing other prompts' prefills), with or without its prefix
cached. Every bf16 GEMM row is pdserve's AMX kernel's (the same sums at any M) and a decode
sequence's attention is split into fixed spans. What is not yet invariant is prefill
attention across chunkings (torch's SDPA; in float32 too, at its own rounding): here every
prompt is prefilled in one chunk."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from native_engine import LLM
from native_engine.kernels import small_gemm
from native_engine.kernels.small_gemm import GemmIsa

pytestmark = pytest.mark.skipif(
    small_gemm.chosen() is not GemmIsa.AMX,
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
