"""Greedy outputs are token-identical to HF transformers, for every supported family."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from native_engine import LLM
from tests.engine.hf_reference import assert_greedy_matches_but_for_ties, hf_greedy, load_hf

BLOCK_SIZE = 16
# 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, and longer.
PROMPT_LENS = [1, 15, 16, 17, 53, 100, 33, 130]
NEW_TOKENS = 32


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def _check_parity(model_dir: Path, llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    prompts = _prompts(vocab)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    hf = load_hf(model_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt len {len(prompt)}"
        assert out.finish_reason == "length"


@pytest.mark.parametrize(
    "arch, kwargs",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "rope_scaling": True}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("qwen3", {"tie_word_embeddings": False}),
    ],
    ids=["llama", "llama-tied-llama3rope", "qwen2", "qwen3", "qwen3-untied"],
)
def test_greedy_matches_hf(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM], arch: str, kwargs: dict
) -> None:
    model_dir = model_factory(arch, **kwargs)
    _check_parity(model_dir, make_llm(model_dir, block_size=BLOCK_SIZE))


def _to_classic_layout(src: Path, dst: Path) -> None:
    """Rewrite config.json the way published (pre-transformers-5) checkpoints spell it."""
    dst.mkdir()
    for item in src.iterdir():
        (dst / item.name).symlink_to(item)
    config = json.loads((src / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        config["rope_scaling"] = params
    config["torch_dtype"] = config.pop("dtype", "float32")
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(config))


def test_classic_config_layout_matches_hf(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    src = model_factory("llama", rope_scaling=True)
    classic = tmp_path / "classic"
    _to_classic_layout(src, classic)
    raw = json.loads((classic / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_scaling"]["rope_type"] == "llama3"
    _check_parity(classic, make_llm(classic))


def test_sharded_checkpoint_matches_hf(
    llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    sharded = tmp_path / "sharded"
    hf = load_hf(llama_dir)
    hf.save_pretrained(str(sharded), max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (sharded / name).write_bytes((llama_dir / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    _check_parity(sharded, make_llm(sharded))


def test_chunked_prefill_and_small_batches_match_hf(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    # A 7-token budget forces every long prompt through several prefill chunks with context.
    _check_parity(llama_dir, make_llm(llama_dir, max_num_batched_tokens=7, max_num_seqs=3))


def test_mistral_matches_hf(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """Mistral is Llama-shaped; make-model does not build it, so save one with transformers."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=None,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(str(tmp_path / "mistral"))
    _check_parity(tmp_path / "mistral", make_llm(tmp_path / "mistral"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_greedy_matches_hf_in_bf16_but_for_ties_it_reports(
    model_factory: Callable[..., Path], make_llm: Callable[..., LLM], arch: str
) -> None:
    """In bf16 (the CPU kernel on), greedy tokens are HF's in bf16. HF's logits are bf16
    numbers: two of them a single bf16 step apart (or equal) are a tie either side may break,
    so a first difference is accepted only there, and reported; never anywhere else."""
    import torch

    model_dir = model_factory(arch)
    llm = make_llm(model_dir, block_size=BLOCK_SIZE, dtype="bfloat16")
    assert llm.engine.loaded.attention_backend.value == "cpu"
    prompts = _prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    hf = load_hf(model_dir, torch.bfloat16)
    outputs = [out.token_ids for out in llm.generate(prompts, params)]
    assert_greedy_matches_but_for_ties(hf, prompts, outputs, NEW_TOKENS, "bfloat16")
