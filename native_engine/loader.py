"""Load HF-format safetensors checkpoints (single file or sharded) into the engine's model.

Each HF tensor name maps to a slice of one engine parameter (q/k/v and gate/up are fused).
Missing tensors are an error naming them; so are unexpected ones, since they usually mean a
checkpoint of another architecture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.checkpoint import checkpoint_files
from engine.model_config import ModelConfig
from native_engine.models.llama import LlamaFamilyForCausalLM

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class _Target:
    param: nn.Parameter
    row_start: int
    rows: int = -1  # -1: the whole parameter

    def destination(self) -> torch.Tensor:
        rows = self.param.shape[0] if self.rows < 0 else self.rows
        return self.param.data[self.row_start : self.row_start + rows]


def _targets(model: LlamaFamilyForCausalLM) -> dict[str, _Target]:
    cfg = model.config
    targets: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target(model.embed_tokens, 0),
        "model.norm.weight": _Target(model.norm.weight, 0),
    }
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = _Target(model.lm_head.weight, 0)
    for i, layer in enumerate(model.decoder_layers()):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        targets[p + "input_layernorm.weight"] = _Target(layer.input_layernorm.weight, 0)
        targets[p + "post_attention_layernorm.weight"] = _Target(
            layer.post_attention_layernorm.weight, 0
        )
        slices = {
            "q": (0, cfg.q_size),
            "k": (cfg.q_size, cfg.kv_size),
            "v": (cfg.q_size + cfg.kv_size, cfg.kv_size),
        }
        for name, (start, rows) in slices.items():
            qkv = attn.qkv_proj
            targets[f"{p}self_attn.{name}_proj.weight"] = _Target(qkv.weight, start, rows)
            if qkv.bias is not None:
                targets[f"{p}self_attn.{name}_proj.bias"] = _Target(qkv.bias, start, rows)
        targets[p + "self_attn.o_proj.weight"] = _Target(attn.o_proj.weight, 0)
        if attn.q_norm is not None and attn.k_norm is not None:
            targets[p + "self_attn.q_norm.weight"] = _Target(attn.q_norm.weight, 0)
            targets[p + "self_attn.k_norm.weight"] = _Target(attn.k_norm.weight, 0)
        mlp = layer.mlp
        inter = cfg.intermediate_size
        targets[p + "mlp.gate_proj.weight"] = _Target(mlp.gate_up_proj.weight, 0, inter)
        targets[p + "mlp.up_proj.weight"] = _Target(mlp.gate_up_proj.weight, inter, inter)
        targets[p + "mlp.down_proj.weight"] = _Target(mlp.down_proj.weight, 0)
    return targets


def load_weights(model: LlamaFamilyForCausalLM, model_dir: Path) -> None:
    targets = _targets(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = targets.get(name)
                if target is None:
                    if not _IGNORED.match(name) and not (
                        name == "lm_head.weight" and model.config.tie_word_embeddings
                    ):
                        unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                dest = target.destination()
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} from config.json"
                    )
                dest.copy_(tensor.to(dest.dtype))
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]} ({len(missing)} in all)")
    if unexpected:
        raise ValueError(
            f"checkpoint has tensors this architecture does not use: {unexpected[:5]} "
            f"({len(unexpected)} in all)"
        )


def build_model(
    config: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaFamilyForCausalLM:
    with torch.device(device):
        model = LlamaFamilyForCausalLM(config, dtype, max_positions)
    load_weights(model, model_dir)
    model.prepack()
    return model.eval()
