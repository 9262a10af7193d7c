"""The Llama family: Llama (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

They differ only in flags carried by ``ModelConfig``. Projections are fused at load time
(q|k|v and gate|up) so a decode step issues few, larger matmuls.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import AttentionBackend
from engine.model_config import ModelConfig
from native_engine.attention import AttentionMetadata, paged_attention
from native_engine.kernels import fused_ops
from native_engine.kv_cache import LayerCache
from native_engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from native_engine.models.linear import Linear


class Attention(nn.Module):
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(
            config.q_size + 2 * config.kv_size, config.hidden_size, dtype, bias=config.qkv_bias
        )
        self.o_proj = Linear(config.hidden_size, config.q_size, dtype)
        norm = config.qk_norm
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim]
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        cfg = self.config
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        heads = [cfg.num_q_heads, cfg.num_kv_heads]
        qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = qk.view(num_tokens, sum(heads), cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split(heads, dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Queries and keys side by side: one rotation for both (per token and head alike).
        q, k = apply_rotary(qk, *rope).split(heads, dim=1)
        out = paged_attention(q, k, v.contiguous(), cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, cfg.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype)
        self._fused: fused_ops.FusedLayerWeights | None = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the last layer's output (or the embeddings)
        residual: torch.Tensor | None,  # the stream before that output: None at layer 0
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's output, the stream before it
        """HF's ``x = x + attn(norm(x)); x = x + mlp(norm(x))`` with each residual add done
        where the next norm reads it (one pass: ``RMSNorm.add_forward``); same roundings."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, cache, meta)
        residual, h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def fused_weights(self) -> fused_ops.FusedLayerWeights | None:
        """What ``fused_ops.decode_layers`` takes of this layer (kept once found, after
        ``prepack``), or None where it cannot run: a GEMM off the small-M kernel, kernels of
        two ISAs, a q/k norm."""
        if self._fused is not None:
            return self._fused
        attn, mlp, cfg = self.self_attn, self.mlp, self.self_attn.config
        kernels = [
            p.small_kernel() for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        found = [k for k in kernels if k is not None]
        if attn.q_norm is not None or len(found) < 4 or len({k[1] for k in found}) != 1:
            return None
        (qkv, isa, _), (o, _, _), (gate_up, _, _), (down, _, _) = found
        self._fused = fused_ops.FusedLayerWeights(
            input_norm=self.input_layernorm.weight,
            post_norm=self.post_attention_layernorm.weight,
            eps=self.input_layernorm.eps,
            qkv=qkv,
            qkv_bias=attn.qkv_proj.bias,
            o=o,
            gate_up=gate_up,
            down=down,
            num_q_heads=cfg.num_q_heads,
            num_kv_heads=cfg.num_kv_heads,
            scale=attn.scale,
            isa=isa,
            max_rows=min(k[2] for k in found),
        )
        return self._fused


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype)
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self._fused: fused_ops.FusedStack | None = None  # set by prepack where all layers fuse
        self.lm_head = Linear(
            config.vocab_size,
            config.hidden_size,
            dtype,
            shared_weight=self.embed_tokens if config.tie_word_embeddings else None,
        )

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def prepack(self) -> None:
        """After loading: move every projection to its fastest GEMM layout."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        weights = [layer.fused_weights() for layer in self.decoder_layers()]
        found = [w for w in weights if w is not None]
        self._fused = fused_ops.FusedStack.of(found) if len(found) == len(weights) else None

    def _fused_decode(
        self, x: torch.Tensor, kv_cache: list[LayerCache], meta: AttentionMetadata
    ) -> bool:
        """Whether this step runs its layers as one C++ call: decode rows only, bf16 or fp32 on
        the CPU kernels, a full-precision cache, and a batch the small-M GEMMs serve."""
        return (
            self._fused is not None
            and not meta.prefills
            and meta.backend is AttentionBackend.CPU
            and x.shape[0] <= self._fused.max_rows
            and not kv_cache[0].quantized
            and fused_ops.applies(x)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: list[LayerCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] (final-normed)
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.lookup(positions)
        residual: torch.Tensor | None = None
        if self._fused_decode(x, kv_cache, meta):
            assert self._fused is not None
            k_caches, v_caches = [c.k for c in kv_cache], [c.v for c in kv_cache]
            x, residual = fused_ops.decode_layers(
                x, None, rope, k_caches, v_caches, meta, self._fused
            )
        else:
            for i, layer in enumerate(self.decoder_layers()):
                x, residual = layer(x, residual, rope, kv_cache[i], meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.lm_head(hidden).float()
