"""Half-precision engines: weights, KV cache and logits in the requested dtype, close to HF.

Token equality is asserted in float32 (test_hf_parity); in 16-bit, two implementations that
round in different places legitimately flip near-ties, so logits are compared with tolerance.
"""

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


@pytest.mark.parametrize(
    "dtype, torch_dtype, atol",
    [("bfloat16", torch.bfloat16, 0.4), ("float16", torch.float16, 0.05)],
)
def test_half_precision_logits_close_to_hf(
    llama_dir: Path,
    make_llm: Callable[..., LLM],
    dtype: str,
    torch_dtype: torch.dtype,
    atol: float,
) -> None:
    llm = make_llm(llama_dir, dtype=dtype)
    engine = llm.engine
    assert engine.kv_cache.tensor.dtype == torch_dtype
    assert engine.loaded.model.embed_tokens.dtype == torch_dtype
    rng = random.Random(6)
    prompt = [rng.randrange(3, 1000) for _ in range(37)]
    seq = PagedSequence("probe", prompt, SamplingParams())
    assert engine.block_manager.allocate_slots(seq, len(prompt))
    _, logits = engine.runner.forward_logits([ScheduledSeq(seq, len(prompt))])
    engine.block_manager.free(seq)
    reference = hf_logits(load_hf(llama_dir, torch_dtype), prompt)
    # Logits are ~10 here: a bf16 ulp is 0.06 there, so a few ulps of drift is expected at worst,
    # and far less on average.
    torch.testing.assert_close(logits, reference, atol=atol, rtol=0.0)
    assert (logits - reference).abs().mean().item() < atol / 8
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 8
