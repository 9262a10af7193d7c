"""What serving needs of any checkpoint, whichever engine runs it: the router and the vLLM engine
read this; the native engine parses the rest of its architecture (``engine.model_config``).

Lenient on purpose: a checkpoint only vLLM can run (a MoE, a quantized one) still has a
vocabulary, EOS ids and a context length the router must know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckpointInfo:
    architecture: str  # the HF class name (architectures[0]), or the model_type
    vocab_size: int
    max_position_embeddings: int
    # config.json's, then generation_config.json's (both end a request unless ignore_eos).
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> CheckpointInfo:
        return cls.from_hf_dict(*read_configs(model_dir))

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> CheckpointInfo:
        text = raw.get("text_config") or raw  # multimodal checkpoints nest the language model
        archs = raw.get("architectures") or [raw.get("model_type") or "unknown"]
        return cls(
            architecture=str(archs[0]),
            vocab_size=_positive(text, "vocab_size"),
            max_position_embeddings=_positive(text, "max_position_embeddings"),
            eos_token_ids=eos_token_ids(text if "eos_token_id" in text else raw, generation),
        )


def eos_token_ids(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> tuple[int, ...]:
    """The ids that end a request (unless ignore_eos): config.json's, then
    generation_config.json's, each once. One rule for every engine and the router."""
    ids = _token_ids(raw.get("eos_token_id")) + _token_ids((generation or {}).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _positive(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def read_configs(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's config.json and generation_config.json (empty when absent)."""
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model: no config.json in {path}")
    generation_path = path / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}
    return read_json(config_path), generation


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index.name}: weight_map must be a non-empty object")
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {model_dir}")
    return files


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: expected a JSON object")
    return data


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
