"""What the engine needs to know about a checkpoint, parsed once from its ``config.json``.

Accepts both layouts in the wild: the classic one (``rope_theta``, ``rope_scaling``,
``torch_dtype``) that published checkpoints use, and the transformers-5 one (``rope_parameters``,
``dtype``). Every rejection names the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from engine.checkpoint import eos_token_ids, read_configs
from engine.dtypes import DTYPE_NAMES


class RopeScalingType(Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling_type: RopeScalingType = RopeScalingType.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ArchitectureTraits:
    """Per-architecture differences inside the Llama family."""

    qkv_bias_default: bool
    qk_norm: bool
    has_sliding_window: bool


ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "LlamaForCausalLM": ArchitectureTraits(False, qk_norm=False, has_sliding_window=False),
    "MistralForCausalLM": ArchitectureTraits(False, qk_norm=False, has_sliding_window=True),
    "Qwen2ForCausalLM": ArchitectureTraits(True, qk_norm=False, has_sliding_window=True),
    "Qwen3ForCausalLM": ArchitectureTraits(False, qk_norm=True, has_sliding_window=True),
}
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    checkpoint_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"config.json: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_q_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.checkpoint_dtype not in DTYPE_NAMES:
            raise ValueError(f"config.json: dtype {self.checkpoint_dtype!r} not in {DTYPE_NAMES}")

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_hf_dict(*read_configs(model_dir))

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        architecture = _architecture(raw)
        traits = ARCHITECTURES[architecture]
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {hidden_act!r} is not supported (silu only)")
        if raw.get("mlp_bias", False):
            raise ValueError("config.json: mlp_bias=true is not supported")
        num_q_heads = _int(raw, "num_attention_heads")
        hidden_size = _int(raw, "hidden_size")
        head_dim = raw.get("head_dim") or hidden_size // num_q_heads
        sliding_window = None
        # Qwen declares a window but only applies it when use_sliding_window is true.
        if (
            traits.has_sliding_window
            and raw.get("sliding_window")
            and raw.get("use_sliding_window", architecture == "MistralForCausalLM")
        ):
            sliding_window = int(raw["sliding_window"])
        return cls(
            architecture=architecture,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            num_layers=_int(raw, "num_hidden_layers"),
            num_q_heads=num_q_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_q_heads),
            head_dim=int(head_dim),
            intermediate_size=_int(raw, "intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=_int(raw, "max_position_embeddings"),
            rope=_rope(raw),
            qkv_bias=bool(raw.get("attention_bias", traits.qkv_bias_default)),
            qk_norm=traits.qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids(raw, generation),
            sliding_window=sliding_window,
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ValueError(f"config.json: architectures must list one class, got {archs!r}")
        name = str(archs[0])
    else:
        model_type = raw.get("model_type")
        if model_type not in _MODEL_TYPE_TO_ARCH:
            raise ValueError(f"config.json: no architectures and unknown model_type {model_type!r}")
        name = _MODEL_TYPE_TO_ARCH[model_type]
    if name not in ARCHITECTURES:
        raise ValueError(
            f"config.json: architectures {name!r} is not supported; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    return name


def _int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config.json: {key} must be an integer, got {value!r}")
    return value


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 folds rope_theta into rope_parameters; older checkpoints keep them apart.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_scaling must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    type_name = params.get("rope_type") or params.get("type") or "default"
    try:
        scaling_type = RopeScalingType(type_name)
    except ValueError:
        supported = [t.value for t in RopeScalingType]
        raise ValueError(
            f"config.json: rope_scaling.rope_type {type_name!r} is not supported; "
            f"supported: {supported}"
        ) from None
    if scaling_type is RopeScalingType.DEFAULT:
        return RopeConfig(theta=float(theta))
    factor = float(params.get("factor", 1.0))
    if factor <= 0:
        raise ValueError(f"config.json: rope_scaling.factor must be > 0, got {factor}")
    if scaling_type is RopeScalingType.LINEAR:
        return RopeConfig(theta=float(theta), scaling_type=scaling_type, factor=factor)
    return RopeConfig(
        theta=float(theta),
        scaling_type=scaling_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
