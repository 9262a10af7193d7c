"""pdserve's bf16 GEMM (``csrc/small_gemm.cpp``): which kernels this CPU has, the one chosen,
where it hands over to oneDNN, and the calls.

Called by ``native_engine.models.linear.Linear``: ``pack`` once per weight after loading (the
packed copy is the layer's to keep), ``gemm`` per forward when the batch has at most
``max_rows(isa)`` rows. A row's result does not depend on M up to that bound, on one ISA: a
request's numerics do not change with how many share its step. AMX serves every M (decode
shapes stream the weights, prefill shapes take panels, bit for bit the same sums), so on AMX
every bf16 GEMM row is batch-invariant; oneDNN's bf16 rows are not (they move with M).
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

    AVX2 = 1  # AVX2 + FMA: bf16 widened to fp32 in registers (no bf16 hardware)
    AVX512_BF16 = 2  # vdpbf16ps
    AMX = 3  # AMX tiles (tdpbf16ps); Sapphire Rapids and later


# Serves any batch.
EVERY_M = sys.maxsize
# The largest M each kernel serves; above it, oneDNN (or F.linear where oneDNN has no bf16
# path). Measured by benchmarks/small_gemm.py on SmolLM2's shapes (docs/engine.md has the
# table): AMX streams weights at the copy bandwidth through M = 16 and above takes
# 32 x 32 panels (~80 % of it at M = 32), level with oneDNN from 64 to 1024 rows (0.86-1.07x
# its time), 1.3x at 2048; vdpbf16ps is ahead through M = 4 and behind at 8, bound by its
# own throughput. The AVX2 kernel's rival, F.linear in bf16 on a CPU without bf16 hardware,
# was not measured: 16 is where it falls to a third of the bandwidth.
_MAX_ROWS = {GemmIsa.AMX: EVERY_M, GemmIsa.AVX512_BF16: 4, GemmIsa.AVX2: 16}


def available() -> list[GemmIsa]:
    """The kernels this build has and this CPU runs (none when the extension does not load)."""
    if not load_cpu_kernels():
        return []
    mask = int(cpu_ops().small_gemm_isas())
    return [isa for isa in GemmIsa if mask >> isa.value & 1]


@functools.cache
def chosen() -> GemmIsa | None:
    """The kernel the engine uses here: the fastest available (logged once)."""
    isas = available()
    isa = max(isas) if isas else None
    logger.info("small-M bf16 GEMM: %s", isa.name if isa is not None else "none (oneDNN)")
    return isa


def max_rows(isa: GemmIsa) -> int:
    return _MAX_ROWS[isa]


def packs(weight: torch.Tensor) -> bool:
    """Whether this weight can take the kernel: bf16 on the CPU, N a multiple of 16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernels' layout of ``weight`` [N, K]: a new tensor, the caller's to keep."""
    packed: torch.Tensor = cpu_ops().pack_bf16_weight(weight)
    return packed


def gemm(
    x: torch.Tensor,  # [M, K] bf16, unit column stride
    packed: torch.Tensor,  # pack's
    bias: torch.Tensor | None,  # [N] bf16
    in_features: int,
    isa: GemmIsa,
) -> torch.Tensor:  # [M, N] bf16
    out: torch.Tensor = cpu_ops().small_gemm_bf16(x, packed, bias, in_features, isa.value)
    return out
