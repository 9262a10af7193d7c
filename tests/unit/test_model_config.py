"""config.json parsing: both layouts, every family's traits, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.model_config import ModelConfig, RopeScalingType

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 2,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_classic_layout() -> None:
    raw = {
        **BASE,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", **LLAMA3},
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope.theta == 500000.0
    assert cfg.rope.scaling_type is RopeScalingType.LLAMA3
    assert cfg.rope.factor == 8.0 and cfg.rope.original_max_position_embeddings == 64
    assert cfg.checkpoint_dtype == "bfloat16"
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.qkv_bias, cfg.qk_norm) == (16, 2, False, False)


def test_transformers5_layout_equals_classic() -> None:
    classic = {
        **BASE,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "llama3", **LLAMA3},
    }
    new = {
        **BASE,
        "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
    }
    assert ModelConfig.from_hf_dict(classic) == ModelConfig.from_hf_dict(new)


def test_family_traits_and_eos_merge() -> None:
    qwen2 = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf_dict(
        {**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}
    )
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128
    mistral = ModelConfig.from_hf_dict(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128}
    )
    assert mistral.sliding_window == 128
    qwen_window = ModelConfig.from_hf_dict(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 128,
            "use_sliding_window": False,
        }
    )
    assert qwen_window.sliding_window is None
    merged = ModelConfig.from_hf_dict(BASE, {"eos_token_id": [7, 2]})
    assert merged.eos_token_ids == (2, 7)
    by_type = ModelConfig.from_hf_dict(
        {**{k: v for k, v in BASE.items() if k != "architectures"}, "model_type": "qwen3"}
    )
    assert by_type.architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"vocab_size": "100"}, "vocab_size"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor"),
        ({"torch_dtype": "float64"}, "dtype"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_bad_config_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**BASE, **change})


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 9)
