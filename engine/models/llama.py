"""The Llama family: Llama (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

They differ only in flags carried by ``ModelConfig``. Projections are fused at load time
(q|k|v and gate|up) so a decode step issues few, larger matmuls.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.model_config import ModelConfig
from engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


def _weight(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class Attention(nn.Module):
    qkv_proj: nn.Parameter
    qkv_bias: nn.Parameter | None
    o_proj: nn.Parameter
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.rotary = rotary
        self.scale = config.head_dim**-0.5
        self.qkv_proj = _weight(config.q_size + 2 * config.kv_size, config.hidden_size, dtype)
        self.qkv_bias = (
            nn.Parameter(
                torch.zeros(config.q_size + 2 * config.kv_size, dtype=dtype), requires_grad=False
            )
            if config.qkv_bias
            else None
        )
        self.o_proj = _weight(config.hidden_size, config.q_size, dtype)
        self.q_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        cfg = self.config
        num_tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_q_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v.contiguous(), k_cache, v_cache, meta, self.scale)
        return F.linear(out.reshape(num_tokens, cfg.q_size), self.o_proj)


class DecoderLayer(nn.Module):
    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: GatedMLP

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaFamilyForCausalLM(nn.Module):
    embed_tokens: nn.Parameter
    lm_head: nn.Parameter
    norm: RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype)
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary, dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight(config.vocab_size, config.hidden_size, dtype)
        )

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] (final-normed)
        x = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return F.linear(hidden, self.lm_head).float()
