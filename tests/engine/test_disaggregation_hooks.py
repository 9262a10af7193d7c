"""Prefill on engine A, move the blocks, decode on engine B: same tokens as one engine."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import PrefilledRequest, SamplingParams
from engine.outputs import RequestOutput
from native_engine import LLM
from native_engine.llm_engine import LLMEngine


def _prefill(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> PrefilledRequest:
    request_id = engine.add_request(prompt, params, prefill_only=True)
    updates = []
    while request_id not in engine.pinned:
        updates.extend(engine.step())
    assert [len(u.new_token_ids) for u in updates] == [1]
    assert updates[0].prefilled
    return engine.export_prefilled(request_id)


def _decode(engine: LLMEngine, prefilled: PrefilledRequest, kv_source: LLMEngine) -> list[int]:
    block_ids = engine.reserve_prefilled(prefilled)
    assert block_ids is not None and len(block_ids) == len(prefilled.block_ids)
    # Layer by layer, as a streaming transport would deliver them.
    for layer in range(kv_source.kv_layout.num_layers):
        engine.kv_cache.write_layer(
            layer, block_ids, kv_source.kv_cache.read_layer(layer, prefilled.block_ids)
        )
    kv_source.free_pinned(prefilled.request_id)
    out = RequestOutput(prefilled.request_id, prefilled.prompt_token_ids)
    first = engine.start_prefilled(prefilled)
    assert first is not None
    out.apply(first)
    while not out.finish_reason:
        for update in engine.step():
            out.apply(update)
    return out.token_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded-top-p", "seeded-top-k"],
)
def test_prefill_on_a_decode_on_b_matches_one_engine(
    llama_dir: Path, make_llm: Callable[..., LLM], params: SamplingParams
) -> None:
    a = make_llm(llama_dir).engine
    b = make_llm(llama_dir).engine
    reference = make_llm(llama_dir)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 16, 37)]
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    for prompt, want in zip(prompts, expected, strict=True):
        prefilled = _prefill(a, prompt, params)
        assert prefilled.first_token_id == want[0]
        assert b.stats().num_prompt_tokens_computed == 0
        assert _decode(b, prefilled, a) == want
    # The decode engine computed no prompt token: every prompt arrived as KV.
    assert b.stats().num_prompt_tokens_computed == 0
    assert a.stats().num_prompt_tokens_computed == sum(len(p) for p in prompts)


def test_layout_and_block_ownership(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    a = make_llm(llama_dir).engine
    b = make_llm(llama_dir, num_blocks=3, block_size=16).engine
    # The cache size is local business; the layout (what a block means) must agree.
    assert a.kv_layout.mismatch(b.kv_layout) is None
    other = make_llm(llama_dir, block_size=8).engine.kv_layout
    message = a.kv_layout.mismatch(other) or ""
    assert "block_size=16" in message and "block_size=8" in message
    assert other.model_fingerprint != a.kv_layout.model_fingerprint  # block size is hashed in
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefilled = _prefill(a, list(range(3, 60)), params)  # 57 tokens = 4 blocks
    used = a.stats().num_blocks - a.stats().num_free_blocks
    assert used == 4 and a.stats().num_pinned == 1
    # B has 3 blocks: reservation is refused without side effects.
    assert b.reserve_prefilled(prefilled) is None
    assert b.stats().num_free_blocks == 3
    # Abort of a pinned request frees it exactly once; a second release is an error.
    assert a.abort(prefilled.request_id)
    assert a.stats().num_free_blocks == a.stats().num_blocks
    with pytest.raises(KeyError):
        a.free_pinned(prefilled.request_id)


def test_abort_after_reserve_frees_decode_blocks(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    a = make_llm(llama_dir).engine
    b = make_llm(llama_dir).engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefilled = _prefill(a, list(range(3, 40)), params)
    assert b.reserve_prefilled(prefilled) is not None
    assert b.stats().num_free_blocks == b.stats().num_blocks - 3
    assert b.abort(prefilled.request_id)  # e.g. the transfer failed its checksum
    assert b.stats().num_free_blocks == b.stats().num_blocks
    a.free_pinned(prefilled.request_id)


def test_seeded_sampling_is_identical_in_another_process(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """The seed alone fixes the tokens: a fresh interpreter reproduces them exactly."""
    import json
    import subprocess
    import sys

    prompt = [7, 8, 9, 10, 11]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=99, ignore_eos=True)
    here = make_llm(llama_dir).generate([prompt], params)[0].token_ids
    code = (
        "import json, sys\n"
        "from native_engine import LLM\n"
        "from engine import SamplingParams\n"
        f"llm = LLM({str(llama_dir)!r})\n"
        "p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=99, ignore_eos=True)\n"
        f"print(json.dumps(llm.generate([{prompt!r}], p)[0].token_ids))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == here
