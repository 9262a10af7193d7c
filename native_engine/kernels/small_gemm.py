"""pdserve's small-M GEMM, bf16 and fp32 (``csrc/small_gemm.cpp``): which kernels this CPU
has for a dtype, the one chosen, where it hands over to oneDNN, and the calls.

Called by ``native_engine.models.linear.Linear``: ``pack`` once per weight after loading (the
packed copy is the layer's to keep), ``gemm`` per forward when the batch has at most
``max_rows(isa, dtype)`` rows. A row's result does not depend on M up to that bound, on one
ISA: a request's numerics do not change with how many share its step. AMX serves every M in
bf16 (decode shapes stream the weights, prefill shapes take panels, bit for bit the same
sums), and both fp32 kernels every M, so there every GEMM row is batch-invariant; oneDNN's
bf16 rows are not (they move with M).
"""

from __future__ import annotations

import enum
import functools
import logging
import sys

import torch

from native_engine.kernels.cpu import cpu_ops, load_cpu_kernels

logger = logging.getLogger(__name__)


class GemmIsa(enum.IntEnum):
    """The kernels, by the instructions they need (values: the C++ ``Isa``)."""

    AVX2 = 1  # AVX2 + FMA: bf16 widened to fp32 in registers (no bf16 hardware); fp32 FMAs
    AVX512_BF16 = 2  # vdpbf16ps (bf16)
    AMX = 3  # AMX tiles (tdpbf16ps; bf16); Sapphire Rapids and later
    AVX512 = 4  # AVX-512F FMAs (fp32)


# The kernels each dtype has, in the order the engine prefers them (the last it runs wins).
_KERNELS = {
    torch.bfloat16: (GemmIsa.AVX2, GemmIsa.AVX512_BF16, GemmIsa.AMX),
    torch.float32: (GemmIsa.AVX2, GemmIsa.AVX512),
}


# Serves any batch.
EVERY_M = sys.maxsize
# The largest M each kernel serves per dtype; above it, oneDNN (or F.linear where oneDNN has
# no path for the dtype). Measured by benchmarks/small_gemm.py on SmolLM2's shapes
# (docs/cpu-kernels.md has the table). bf16: AMX streams weights at the copy bandwidth through
# M = 16 and above takes 32 x 32 panels (~80 % of it at M = 32), level with oneDNN from 64 to
# 1024 rows (0.86-1.07x its time), 1.3x at 2048; vdpbf16ps is ahead through M = 4 and behind
# at 8, bound by its own throughput. The AVX2 kernel's rival, F.linear in bf16 on a CPU
# without bf16 hardware, was not measured: 16 is where it falls to a third of the bandwidth.
# fp32: the AVX-512F kernel streams weights at 1.15-1.3x oneDNN's packed fp32 path's speed
# through M = 32 and is level with it from 128 to 2048 rows (0.93-1.04x); the AVX2 kernel,
# against oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, the same box), is 1.1-1.4x through
# M = 32 and 0.85x at 128-512. Both serve every M: one packing, and a row's bits do not depend
# on its batch (fp32 is the default dtype where bf16 has no hardware: equal exactness).
_MAX_ROWS = {
    torch.bfloat16: {GemmIsa.AMX: EVERY_M, GemmIsa.AVX512_BF16: 4, GemmIsa.AVX2: 16},
    torch.float32: {GemmIsa.AVX512: EVERY_M, GemmIsa.AVX2: EVERY_M},
}


def available(dtype: torch.dtype) -> list[GemmIsa]:
    """The kernels for ``dtype`` this build has and this CPU runs (none when the extension
    does not load), in the engine's order of preference, least first."""
    if dtype not in _KERNELS or not load_cpu_kernels():
        return []
    mask = int(cpu_ops().small_gemm_isas())
    return [isa for isa in _KERNELS[dtype] if mask >> isa.value & 1]


@functools.cache
def chosen(dtype: torch.dtype) -> GemmIsa | None:
    """The kernel the engine uses here for ``dtype``: the preferred available (logged once)."""
    isas = available(dtype)
    isa = isas[-1] if isas else None
    name = isa.name if isa is not None else "none (oneDNN)"
    logger.info("small-M %s GEMM: %s", str(dtype).removeprefix("torch."), name)
    return isa


def max_rows(isa: GemmIsa, dtype: torch.dtype) -> int:
    return _MAX_ROWS[dtype][isa]


def packs(weight: torch.Tensor) -> bool:
    """Whether this weight can take a kernel: bf16 or fp32 on the CPU, N a multiple of 16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in _KERNELS
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernels' layout of ``weight`` [N, K] (its dtype's): a new tensor, the caller's to
    keep."""
    packed: torch.Tensor = cpu_ops().pack_weight(weight)
    return packed


def gemm(
    x: torch.Tensor,  # [M, K] bf16 or fp32, unit column stride
    packed: torch.Tensor,  # pack's, of a weight in x's dtype
    bias: torch.Tensor | None,  # [N], x's dtype
    in_features: int,
    isa: GemmIsa,  # one of available(x.dtype)
) -> torch.Tensor:  # [M, N], x's dtype
    out: torch.Tensor = cpu_ops().small_gemm(x, packed, bias, in_features, isa.value)
    return out


def gemm_silu_mul(
    x: torch.Tensor,  # as gemm's
    packed: torch.Tensor,  # pack's, of a gate_up weight [2 * size, K] (gate | up)
    bias: torch.Tensor | None,
    in_features: int,
    isa: GemmIsa,
) -> torch.Tensor:  # [M, size]: silu(gate) * up
    """``fused_ops.silu_mul(gemm(...))`` bit for bit; on AMX one pass, where the [M, 2 * size]
    product is never written (each half whole blocks of 16)."""
    out: torch.Tensor = cpu_ops().small_gemm_silu_mul(x, packed, bias, in_features, isa.value)
    return out
