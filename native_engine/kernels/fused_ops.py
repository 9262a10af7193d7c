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

from collections.abc import Sequence
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
    """A decoder layer's constants for ``decode_layers``, gathered once after loading
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

    def shared(self) -> tuple[float, bool, int, int, float, GemmIsa]:
        """What every layer of one ``decode_layers`` call has alike."""
        has_bias = self.qkv_bias is not None
        return self.eps, has_bias, self.num_q_heads, self.num_kv_heads, self.scale, self.isa


@dataclass(frozen=True)
class FusedStack:
    """Decoder layers that run as one ``decode_layers`` call: each weight as a tuple, layer i's
    at index i, and the constants they share. Built once, after loading
    (``LlamaFamilyForCausalLM.prepack``)."""

    input_norms: tuple[torch.Tensor, ...]
    post_norms: tuple[torch.Tensor, ...]
    qkv: tuple[torch.Tensor, ...]
    qkv_biases: tuple[torch.Tensor, ...]  # empty where the model has none
    o: tuple[torch.Tensor, ...]
    gate_up: tuple[torch.Tensor, ...]
    down: tuple[torch.Tensor, ...]
    first: FusedLayerWeights  # the shared constants: the first layer's, every layer's alike
    max_rows: int  # the largest batch every layer serves

    @classmethod
    def of(cls, layers: Sequence[FusedLayerWeights]) -> FusedStack | None:
        """The stack, or None where there are no layers or they differ in a shared constant."""
        if not layers or len({w.shared() for w in layers}) != 1:
            return None
        return cls(
            input_norms=tuple(w.input_norm for w in layers),
            post_norms=tuple(w.post_norm for w in layers),
            qkv=tuple(w.qkv for w in layers),
            qkv_biases=tuple(w.qkv_bias for w in layers if w.qkv_bias is not None),
            o=tuple(w.o for w in layers),
            gate_up=tuple(w.gate_up for w in layers),
            down=tuple(w.down for w in layers),
            first=layers[0],
            max_rows=min(w.max_rows for w in layers),
        )


def decode_layers(
    x: torch.Tensor,  # [tokens, hidden]
    residual: torch.Tensor | None,  # the residual stream before x; None at layer 0
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [tokens, 1, head_dim]
    # one per layer: [blocks, block_size, kv_heads, head_dim], x's dtype; written here
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    meta: AttentionMetadata,
    stack: FusedStack,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode-only step's decoder layers, in one call (``LlamaFamilyForCausalLM.forward``):
    the last layer's output and the residual stream before it."""
    w = stack.first
    out, stream = cpu_ops().decode_layers(
        x,
        residual,
        stack.input_norms,
        stack.post_norms,
        w.eps,
        stack.qkv,
        stack.qkv_biases,
        stack.o,
        stack.gate_up,
        stack.down,
        *rope,
        k_caches,
        v_caches,
        meta.slot_mapping,
        meta.decode_block_tables,
        meta.decode_context_lens,
        w.num_q_heads,
        w.num_kv_heads,
        w.scale,
        w.isa.value,
    )
    return out, stream
