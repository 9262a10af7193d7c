"""Linear layers that keep HF's weight layout but run on the fastest GEMM available.

On CPU, torch's default ``F.linear`` goes through a path that is 2-4x slower than oneDNN on the
small-M (decode) shapes that dominate serving. After loading, ``prepack`` reorders each weight
once into oneDNN's blocked layout (the same private ops inductor's weight freezing uses): fp32
always, bf16 where the CPU has native bf16 dot products (AVX512-BF16 or AMX: oneDNN says so), and
fp16 where it has AVX512-FP16 / AVX-NE-CONVERT. A packed call costs ~50 us more up front, so
weights under 128K elements stay on ``F.linear``.

In bf16 and fp32, batches of up to ``small_gemm.max_rows`` rows take pdserve's own kernel
instead (``native_engine/kernels/small_gemm.py``): oneDNN's small-M paths read weights at
50-75 % of the memory's bandwidth, this one at about all of it, and a row's result does not
depend on how many rows share the call (oneDNN's bf16 rows do). On AMX (bf16) and AVX-512F
(fp32) it serves every M, prefill included, and its packing is the only copy kept; on the
other kernels oneDNN's is kept too, for prefill. Results agree with ``F.linear`` in bf16 to
the last bit but for a rounding in ~1e-4 of the elements, in fp32 within the fp32 sum's error
bound (sums in another order; tests/engine/test_small_gemm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from native_engine.kernels import small_gemm

_PACK_MIN_NUMEL = 1 << 17


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs GEMMs of this dtype natively on this CPU."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class Linear(nn.Module):
    def __init__(
        self,
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
        bias: bool = False,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.weight = (
            shared_weight
            if shared_weight is not None
            else nn.Parameter(
                torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
            )
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self._owns_weight = shared_weight is None
        self._packed: torch.Tensor | None = None
        self._small: torch.Tensor | None = None  # small_gemm's packing
        self._small_isa: small_gemm.GemmIsa | None = None
        self._small_rows = 0  # the largest M it serves

    def prepack(self) -> None:
        """Call once, after the weights are loaded."""
        w = self.weight
        if w.device.type != "cpu":
            return
        # Any size: the kernel has no fixed cost to amortize, unlike oneDNN's packed call.
        isa = small_gemm.chosen(w.dtype) if small_gemm.packs(w) else None
        if isa is not None:
            self._small = small_gemm.pack(w.data)
            self._small_isa, self._small_rows = isa, small_gemm.max_rows(isa, w.dtype)
        if self._small_rows == small_gemm.EVERY_M or (
            w.numel() < _PACK_MIN_NUMEL or not onednn_packs(w.dtype)
        ):
            if self._small_rows == small_gemm.EVERY_M and self._owns_weight:
                w.data = torch.empty(0, dtype=w.dtype)  # the kernel's packing serves every M
            return  # else F.linear for larger M (prefill) on the weight as loaded
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.data)
        if self._owns_weight:
            # The packed copy is the only one used from now on.
            w.data = torch.empty(0, dtype=w.dtype)

    def small_kernel(self) -> tuple[torch.Tensor, small_gemm.GemmIsa, int] | None:
        """The small-M kernel's packing, its ISA and the largest M it serves; None where this
        layer has none (a fused caller then takes ``forward``)."""
        if self._small is None or self._small_isa is None:
            return None
        return self._small, self._small_isa, self._small_rows

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this layer's output (gate | up: a gated MLP's gate_up), in
        one call that is the two ops' bits; None where the small-M kernel does not serve x
        (the caller then takes ``forward`` and its own SiLU x up)."""
        if self._small_isa is None or x.shape[0] > self._small_rows:
            return None
        assert self._small is not None
        return small_gemm.gemm_silu_mul(x, self._small, self.bias, x.shape[1], self._small_isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self._small_isa is not None and x.shape[0] <= self._small_rows:
            assert self._small is not None
            return small_gemm.gemm(x, self._small, self.bias, x.shape[1], self._small_isa)
        if self._packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)
