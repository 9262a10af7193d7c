"""The paged KV cache: one preallocated tensor, plus block-level reads and writes.

Layout: ``[num_layers, 2 (k|v), num_blocks, *slab_shape]``. Layer-major, so one layer's blocks
can be read, shipped and written while the next layer is in flight. In full precision the slab
is ``[block_size, num_kv_heads, head_dim]`` and ``tensor[layer, 0]`` is a contiguous per-layer
key cache for the kernels; quantized, the slab is bytes (codes, then scales: see
``engine.kv_layout``) and ``layers`` holds the typed views the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_layout import KVCacheDtype, KVCacheLayout
from engine.page_tensor import PageTensor
from native_engine.kv_quant import codebook

__all__ = ["KVCache", "KVCacheLayout", "LayerCache"]


@dataclass(frozen=True)
class LayerCache:
    """One layer's keys and values, as views of the cache tensor (built once)."""

    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]: dtype, or uint8 codes
    v: torch.Tensor
    kind: KVCacheDtype = KVCacheDtype.AUTO
    k_scales: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] f32 (quantized)
    v_scales: torch.Tensor | None = None
    codebook: torch.Tensor | None = None  # [256] f32: the value of each code (quantized)

    @property
    def quantized(self) -> bool:
        return self.kind.quantized


class KVCache(PageTensor):
    """The native engine's cache: the page tensor, and each layer's views for the kernels."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int, device: torch.device) -> None:
        super().__init__(layout, num_blocks, device)
        self.layers = [self._layer(i) for i in range(layout.num_layers)]

    def _layer(self, layer: int) -> LayerCache:
        lo = self.layout
        if not lo.quantized:
            return LayerCache(self.tensor[layer, 0], self.tensor[layer, 1])
        heads = (lo.block_size, lo.num_kv_heads)
        slabs = self.tensor[layer]  # [2, num_blocks, slab_block_bytes]
        codes = slabs[..., : lo.num_codes_per_slab].unflatten(-1, (*heads, lo.head_dim))
        scales = slabs[..., lo.num_codes_per_slab :].view(torch.float32).unflatten(-1, heads)
        book = codebook(lo.kv_cache_dtype, self.tensor.device)
        return LayerCache(codes[0], codes[1], lo.kv_cache_dtype, scales[0], scales[1], book)
