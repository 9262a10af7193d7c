"""Edge cases of the engine's contracts: ids, pinning, validation against the model, kernels."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from engine import PrefilledRequest, SamplingParams
from engine.sampling import SampleRequest
from native_engine import LLM
from native_engine.kernels.cpu import load_cpu_kernels, paged_decode_attention_cpu
from native_engine.sampler import Sampler

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_request_ids_are_unique_across_waiting_pinned_and_reserved(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    engine = make_llm(llama_dir).engine
    request = PrefilledRequest("x", [5, 6, 7], 9, GREEDY, block_ids=[0])
    assert engine.reserve_prefilled(request) is not None
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([5, 6], GREEDY, request_id="x")
    engine.add_request([5, 6], GREEDY, request_id="y", prefill_only=True)
    while "y" not in engine.pinned:
        engine.step()
    with pytest.raises(ValueError, match="request_id"):
        engine.reserve_prefilled(PrefilledRequest("y", [5, 6], 9, GREEDY, block_ids=[0]))
    assert engine.abort("x") and engine.abort("y")


def test_prefill_only_request_that_cannot_fit_is_not_pinned(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    engine = make_llm(llama_dir, block_size=4, num_blocks=4).engine
    engine.add_request(list(range(3, 33)), GREEDY, request_id="big", prefill_only=True)
    updates = engine.step()
    assert [(u.finish_reason, u.prefilled, u.new_token_ids) for u in updates] == [
        ("length", False, [])
    ]
    assert "big" not in engine.pinned


def test_text_prompt_tokens_outside_the_model_vocab_are_rejected(
    llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    model_dir = tmp_path / "added-token"
    shutil.copytree(llama_dir, model_dir)
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens(["<tool_call>"])  # lands past the model's embedding rows
    tok.save(str(model_dir / "tokenizer.json"))
    llm = make_llm(model_dir)
    assert tok.token_to_id("<tool_call>") >= llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="prompt has ids outside the vocabulary"):
        llm.generate(["hi <tool_call>"], GREEDY)
    assert llm.generate(["hi"], GREEDY)[0].finish_reason == "length"


def test_params_are_checked_against_the_model(
    llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5]], SamplingParams(stop_token_ids=[10**9]))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, bare / name)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        make_llm(bare).generate([[5]], SamplingParams(stop=["x"]))


def test_tiny_temperature_is_greedy(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(llama_dir)
    prompts = [[5, 6, 7], list(range(3, 40))]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tiny = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True))
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_min_p_applies_before_top_p() -> None:
    # p = [.5, .3, .2]: min_p 0.5 keeps only token 0; applied after top_p it would keep 0 and 1.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(torch.device("cpu"))
    params = [SamplingParams(temperature=1.0, top_p=0.6, min_p=0.5, seed=s) for s in range(64)]
    tokens = {sampler(logits, [SampleRequest(p, 0)]).token_ids[0] for p in params}
    assert tokens == {0}


def test_checkpoint_tensor_smaller_than_config_is_rejected(
    llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    model_dir = tmp_path / "short"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] += 64
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(embed_tokens|lm_head)\.weight has shape"):
        make_llm(model_dir)


def test_cpu_kernel_rejects_out_of_range_blocks() -> None:
    assert load_cpu_kernels()
    k_cache = torch.zeros(4, 4, 2, 8)
    query = torch.zeros(1, 4, 8)
    lens = torch.tensor([6], dtype=torch.int32)
    bad_table = torch.tensor([[1, 9]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_attention_cpu(query, k_cache, k_cache, bad_table, lens, 1.0)
    ok_table = torch.tensor([[1, 2]], dtype=torch.int32)
    out = paged_decode_attention_cpu(query, k_cache, k_cache, ok_table, lens, 1.0)
    assert out.shape == (1, 4, 8)
