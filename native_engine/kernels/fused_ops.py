"""The step's elementwise work fused (``csrc/fused_ops.cpp``, ``csrc/fused_ops_f32.cpp``):
RMSNorm with the residual add before it, rotary, SiLU x up. Called by
``native_engine.models.layers`` for bf16 and fp32 tensors on the CPU; every other dtype and
device takes torch's ops, which round the same way. And the sampler's argmax over fp32 logits
(``argmax``, ``csrc/argmax_rows.cpp``: torch's answer, ties and NaN included).

Rotary and SiLU x up are torch's (and so HF's) bit for bit. fp32 RMSNorm is torch's own op
(HF's bits); bf16 RMSNorm's sum of squares is one fp32 sum whose order can differ from
torch's: a result then moves by one bf16 rounding (tests/engine/test_fused_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from native_engine.kernels.cpu import cpu_ops, load_cpu_kernels
from native_engine.kernels.small_gemm import GemmIsa

if TYPE_CHECKING:
    from native_engine.attention import AttentionMetadata


def applies(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the fused ops: bf16 or fp32 on the CPU, the extension built."""
    return (
        x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu" and load_cpu_kernels()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * round(x * rsqrt(mean(x²) + eps))`` over ``x`` [rows, size]'s last dim."""
    y: torch.Tensor = cpu_ops().rms_norm(x, weight, eps)
    return y


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + delta`` (rounded to the dtype) and its RMSNorm, in one pass."""
    total, normed = cpu_ops().add_rms_norm(residual, delta, weight, eps)
    return total, normed


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``layers.apply_rotary``: x [tokens, heads, head_dim], rows contiguous."""
    y: torch.Tensor = cpu_ops().rotary(x, cos, signed_sin)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of gate_up [rows, 2 * size] (gate | up)."""
    y: torch.Tensor = cpu_ops().silu_mul(gate_up)
    return y


def _cpu_rows(x: torch.Tensor) -> bool:
    """fp32 rows [rows, n > 0] on the CPU, unit column stride, the kernels built: what the
    sampler's kernels take."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and load_cpu_kernels()
    )


def races_here(probs: torch.Tensor) -> bool:
    """Whether ``exponential_race`` takes these probabilities."""
    return _cpu_rows(probs)


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Each row's ``argmax(p / q)``, q ~ Exp(1) drawn from the row's int64 seed by a counter-based
    generator (``csrc/exponential_race.cpp``), rows in parallel; where ``races_here``."""
    out: torch.Tensor = cpu_ops().exponential_race(probs, seeds)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of [rows, n] logits: the first largest, a NaN counting as
    largest; rows in parallel on the CPU (torch's is one thread)."""
    if _cpu_rows(x):
        out: torch.Tensor = cpu_ops().argmax_rows(x)
        return out
    return x.argmax(dim=-1)


@dataclass(frozen=True)
class FusedLayerWeights:
    """A decoder layer's constants for ``decode_layer``, gathered once after loading
    (``DecoderLayer.fused_weights``)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor  # the projections, packed by small_gemm.pack
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    scale: float
    isa: GemmIsa
    max_rows: int  # the largest batch every GEMM's kernel serves


def decode_layer(
    x: torch.Tensor,  # [tokens, hidden]
    residual: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [tokens, 1, head_dim]
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim], x's dtype: written here
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    w: FusedLayerWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of a decode-only step (``DecoderLayer.fused_decode``): its output
    and the residual stream before it."""
    out, stream = cpu_ops().decode_layer(
        x,
        residual,
        w.input_norm,
        w.post_norm,
        w.eps,
        w.qkv,
        w.qkv_bias,
        w.o,
        w.gate_up,
        w.down,
        *rope,
        k_cache,
        v_cache,
        meta.slot_mapping,
        meta.decode_block_tables,
        meta.decode_context_lens,
        w.num_q_heads,
        w.num_kv_heads,
        w.scale,
        w.isa.value,
    )
    return out, stream
