"""What serving needs of any checkpoint, whichever engine runs it: the router and the vLLM engine
read this; the native engine parses the rest of its architecture (``engine.model_config``).

Lenient on purpose: a checkpoint only vLLM can run (a MoE, a quantized one) still has a
vocabulary, EOS ids and a context length the router must know.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.model_config import read_json, token_ids_of


@dataclass(frozen=True)
class CheckpointInfo:
    architecture: str  # the HF class name (architectures[0]), or the model_type
    vocab_size: int
    max_position_embeddings: int
    # config.json's, then generation_config.json's (both end a request unless ignore_eos).
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> CheckpointInfo:
        path = Path(model_dir)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model: no config.json in {path}")
        generation_path = path / "generation_config.json"
        generation = read_json(generation_path) if generation_path.is_file() else {}
        return cls.from_hf_dict(read_json(config_path), generation)

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> CheckpointInfo:
        text = raw.get("text_config") or raw  # multimodal checkpoints nest the language model
        archs = raw.get("architectures") or [raw.get("model_type") or "unknown"]
        eos = token_ids_of(text.get("eos_token_id", raw.get("eos_token_id")))
        eos += token_ids_of((generation or {}).get("eos_token_id"))
        return cls(
            architecture=str(archs[0]),
            vocab_size=_positive(text, "vocab_size"),
            max_position_embeddings=_positive(text, "max_position_embeddings"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )


def _positive(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value
