"""app.make_model: tiny random checkpoints must load, round-trip and be reproducible."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.make_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_config,
    make_model,
    train_tokenizer,
)

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
TEXTS = [
    "Hello, world! The café on Straße 12 charges €4.50 — über cheap.",
    "東京 and 大阪 🙂🚀 ありがとう 안녕하세요\n\n  two  spaces\tand a tab. 1234567890",
    " leading space, trailing space ",
    "",
]


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core box OpenMP
    # contention made each forward ~100x slower (0.45 s vs 0.005 s).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch=arch, seed=0) for arch in ARCH_CLASSES}


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_loads_cleanly_with_expected_architecture(built: dict[str, Path], arch: str) -> None:
    d = built[arch]
    assert {p.name for p in d.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    loaded: Any = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    model, info = loaded
    assert all(not v for v in info.values()), info
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert _config(d)["architectures"] == [ARCH_CLASSES[arch]]


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_tokenizer_round_trips_and_matches_autotokenizer(built: dict[str, Path], arch: str) -> None:
    d = built[arch]
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(d)
    # qwen2 is forced through Qwen2Tokenizer, which must not grow the vocab.
    assert len(auto) == raw.get_vocab_size()
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert raw.decode(ids) == text
        assert auto.encode(text) == ids, "AutoTokenizer and tokenizer.json disagree"
        assert auto.decode(ids) == text
    multibyte = raw.encode("🙂").ids
    assert raw.decode(multibyte) == "🙂"
    # Qwen-style: no BOS/EOS added by a post-processor.
    assert raw.token_to_id(BOS_TOKEN) not in raw.encode("hello").ids


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_special_token_ids_match_config(built: dict[str, Path], arch: str) -> None:
    d = built[arch]
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    cfg = _config(d)
    assert cfg["bos_token_id"] == raw.token_to_id(BOS_TOKEN)
    assert cfg["eos_token_id"] == raw.token_to_id(EOS_TOKEN)
    assert cfg["pad_token_id"] == raw.token_to_id(PAD_TOKEN)
    assert len({raw.token_to_id(t) for t in SPECIAL_TOKENS}) == 3
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    assert cfg["vocab_size"] >= raw.get_vocab_size()
    assert cfg["vocab_size"] % 8 == 0


def test_same_seed_is_byte_identical(built: dict[str, Path], tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", arch="llama", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (built["llama"] / name).read_bytes(), name


def test_different_seed_changes_every_tensor(built: dict[str, Path], tmp_path: Path) -> None:
    other = make_model(tmp_path / "other", arch="llama", seed=1)
    a = load_file(built["llama"] / "model.safetensors")
    b = load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert not torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_norms_and_biases_are_not_constant(built: dict[str, Path], arch: str) -> None:
    weights = load_file(built[arch] / "model.safetensors")
    norms = {k: v for k, v in weights.items() if "norm" in k}
    biases = {k: v for k, v in weights.items() if k.endswith(".bias")}
    assert norms
    for key, w in norms.items():
        assert w.std() > 0.05 and abs(w.mean().item() - 1.0) < 0.1, key
    if arch == "qwen3":
        assert any("q_norm" in k for k in norms) and any("k_norm" in k for k in norms)
    if arch == "qwen2":
        assert {k.rsplit(".", 2)[-2] for k in biases} == {"q_proj", "k_proj", "v_proj"}
    else:
        assert not biases
    for key, b in biases.items():
        assert b.abs().min() > 0 and b.std() > 0.05, key


def test_arch_specific_config(built: dict[str, Path]) -> None:
    llama, qwen2, qwen3 = (_config(built[a]) for a in ARCH_CLASSES)
    assert llama["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(built["llama"] / "model.safetensors")
    assert qwen2["tie_word_embeddings"] is True and qwen3["tie_word_embeddings"] is True
    assert qwen3["head_dim"] == 32 != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    q_proj = load_file(built["qwen3"] / "model.safetensors")[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    assert tuple(q_proj.shape) == (4 * 32, 64)
    for cfg in (llama, qwen2, qwen3):
        assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
        assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
        assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_overrides_tie_rope_scaling_and_dtype(tmp_path: Path) -> None:
    d = make_model(
        tmp_path / "m",
        "llama",
        seed=3,
        dtype="bfloat16",
        tie_word_embeddings=True,
        rope_scaling=True,
    )
    cfg = _config(d)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["dtype"] == "bfloat16"
    assert cfg["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    weights = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"size": "huge"}, "size"),
        ({"arch": "qwen2", "rope_scaling": True}, "rope_scaling"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_invalid_arguments_raise(tmp_path: Path, kwargs: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        make_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_greedy_generation_is_not_degenerate(built: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(built[arch]).eval()
    seqs = torch.randint(3, 1024, (4, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        top1 = model(seqs).logits[:, -1].softmax(-1).max(-1).values
        # Plain greedy loop: no EOS stopping, no generate() defaults to reason about.
        for _ in range(32):
            next_ids = model(seqs).logits[:, -1].argmax(-1, keepdim=True)
            seqs = torch.cat([seqs, next_ids], dim=1)
    assert (top1 > 0.02).all() and (top1 < 0.999).all()
    distinct = [len(set(row[-16:].tolist())) for row in seqs]
    assert max(distinct) > 4, distinct


def test_small_config_without_building_weights() -> None:
    tok = train_tokenizer(4096)
    vocab = tok.get_vocab()
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    cfg = build_config("llama", "small", tok.get_vocab_size(), ids)
    assert cfg.vocab_size == 32000 > tok.get_vocab_size()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (512, 8, 1408)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert 45e6 < sum(p.numel() for p in model.parameters()) < 60e6
    # Ids past the tokenizer's vocab decode to nothing rather than raising.
    assert tok.decode([tok.get_vocab_size() + 100]) == ""
    assert build_config("qwen3", "small", 4096, ids).head_dim == 128
