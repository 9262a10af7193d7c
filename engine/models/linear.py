"""Linear layers that keep HF's weight layout but run on the fastest GEMM available.

On CPU, torch's default ``F.linear`` goes through a path that is 2-4x slower than oneDNN on the
small-M (decode) shapes that dominate serving. After loading, ``prepack`` reorders each fp32
weight once into oneDNN's blocked layout (the same private ops inductor's weight freezing uses).
A packed call costs ~50 us more up front, so (measured on 2 cores, benchmarks/engine_decode.py):
- weights of >= 1M elements use only the packed copy (it wins even at one row),
- weights of 128K..1M elements keep both and pick per call by the work (rows x weight size),
- smaller weights are never packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACK_ONLY_NUMEL = 1 << 20
_PACK_MIN_NUMEL = 1 << 17
_PACKED_MIN_MACS = 1 << 20


def _onednn_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


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
        self._min_packed_rows = 1

    def prepack(self) -> None:
        """Call once, after the weights are loaded."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not _onednn_available():
            return
        numel = w.numel()
        if numel < _PACK_MIN_NUMEL:
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.data)
        self._min_packed_rows = 1 if numel >= _PACK_ONLY_NUMEL else -(-_PACKED_MIN_MACS // numel)
        if self._owns_weight and numel >= _PACK_ONLY_NUMEL:
            # The packed copy is the only one used from now on.
            w.data = torch.empty(0, dtype=w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self._packed is not None and x.shape[0] >= self._min_packed_rows:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)
