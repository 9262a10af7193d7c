"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP.

Numerics follow HF transformers on purpose (norm in fp32 then cast, rotary tables in fp32 then
cast), because the engine's contract is token-for-token equality with it. In bf16 on the CPU
each takes one fused op (``native_engine/kernels/fused_ops.py``) that rounds as these do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import RopeConfig, RopeScalingType
from native_engine.kernels import fused_ops
from native_engine.models.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if x.dim() == 2 and x.stride(-1) == 1 and fused_ops.applies(x):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # HF: x32 = x.float(); x32 * rsqrt(mean(x32²) + eps), cast back, times the weight in
        # x's dtype. rms_norm computes the same in fp32 and casts back (bit for bit, checked
        # by tests/engine/test_layers_exact.py) in one kernel instead of six.
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)

    def add_forward(
        self, delta: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, size] each -> the sum, its norm
        """HF's ``x = residual + delta`` (in x's dtype) and then ``norm(x)``: both returned."""
        if fused_ops.applies(residual) and delta.stride(-1) == residual.stride(-1) == 1:
            return fused_ops.add_rms_norm(residual, delta, self.weight, self.eps)
        total = residual + delta
        return total, self(total)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] fp32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type is RopeScalingType.LINEAR:
        return inv_freq / rope.factor
    if rope.scaling_type is RopeScalingType.LLAMA3:
        # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables (rotate-half convention), indexed by absolute position. The
    sin table's first half is negated: ``rotate_half(x) * sin == x.roll(half) * signed_sin``
    exactly (a sign flip is exact), so rotation takes one roll instead of slices, a negation
    and a concatenation."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        sin = emb.sin().to(dtype)
        half = head_dim // 2
        self.register_buffer("signed_sin", torch.cat((-sin[:, :half], sin[:, half:]), -1), False)
        self.cos: torch.Tensor
        self.signed_sin: torch.Tensor

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for a step's positions, ``[num_tokens, 1, head_dim]``; once per
        step."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]: queries, keys, or both side by side
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor,  # RotaryEmbedding.lookup's
) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, rounded op by op as it is."""
    if x.stride(-1) == 1 and x.stride(1) == x.shape[-1] and fused_ops.applies(x):
        return fused_ops.rotary(x, cos, signed_sin)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(2 * intermediate_size, hidden_size, dtype)
        self.down_proj = Linear(hidden_size, intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        act = self.gate_up_proj.forward_silu_mul(x)  # on AMX the product is never written
        if act is not None:
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if fused_ops.applies(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
