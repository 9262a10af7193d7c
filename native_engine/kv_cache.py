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

from engine.dtypes import torch_dtype
from engine.kv_layout import KVCacheDtype, KVCacheLayout
from engine.kv_pages import DenseKVPages, SlabSpans
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


class KVCache(DenseKVPages):
    """The native engine's cache: every layer's blocks in one tensor (``DenseKVPages`` for the
    transfer backends; NIXL registers the tensor whole)."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(
            layout.num_layers,
            2,
            num_blocks,
            *layout.slab_shape,
            dtype=torch_dtype(layout.storage_dtype),
            device=device,
        )
        # What block copies move: a quantized cache as int32 words (its slabs are a multiple
        # of 4 bytes), since torch's index kernels copy uint8 rows a byte at a time (~8x slower).
        self.words = self.tensor.view(torch.int32) if layout.quantized else self.tensor
        self.layers = [self._layer(i) for i in range(layout.num_layers)]

    def spans(self) -> SlabSpans:
        size = self.layout.slab_block_bytes
        base, count = self.tensor.data_ptr(), 2 * self.layout.num_layers
        device = self.tensor.device
        return SlabSpans(
            (self.tensor,),
            tuple(base + s * self.num_blocks * size for s in range(count)),
            (size,) * count,
            (device.index or 0) if device.type == "cuda" else 0,
        )

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

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        self.check_block_ids(block_ids)
        return torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)

    def _storage(self, words: torch.Tensor) -> torch.Tensor:
        return words.view(self.tensor.dtype)

    def _words(self, data: torch.Tensor) -> torch.Tensor:
        return data.view(self.words.dtype)

    def read_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """``[2, num_blocks, *slab_shape]``, a contiguous copy."""
        return self._storage(self.words[layer][:, self._index(block_ids)])

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Every layer of the given blocks: ``[num_layers, 2, num_blocks, *slab_shape]``, a
        contiguous copy."""
        return self._storage(self.words.index_select(2, self._index(block_ids)))

    def read_slabs(self, first: int, num_slabs: int, block_ids: list[int]) -> torch.Tensor:
        slabs = self._slabs(first, num_slabs)  # [num_slabs, num_blocks, ...]
        return self._storage(slabs.index_select(1, self._index(block_ids)))

    def _slabs(self, first: int, num_slabs: int) -> torch.Tensor:
        self.check_slabs(first, num_slabs)
        total = 2 * self.layout.num_layers
        return self.words.view(total, *self.words.shape[2:])[first : first + num_slabs]

    def write_slabs(self, first: int, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (len(block_ids), *self.tensor.shape[3:])
        if data.dim() < 1 or tuple(data.shape[1:]) != expected or data.dtype != self.tensor.dtype:
            raise ValueError(
                f"slab data has shape {tuple(data.shape)} {data.dtype}, expected "
                f"(num_slabs, {', '.join(map(str, expected))}) {self.tensor.dtype}"
            )
        slabs = self._slabs(first, data.shape[0])
        slabs.index_copy_(1, self._index(block_ids), self._words(data.to(self.tensor.device)))

    def write_layer(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (2, len(block_ids), *self.tensor.shape[3:])
        if tuple(data.shape) != expected or data.dtype != self.tensor.dtype:
            raise ValueError(
                f"layer data has shape {tuple(data.shape)} {data.dtype}, "
                f"expected {expected} {self.tensor.dtype}"
            )
        self.words[layer][:, self._index(block_ids)] = self._words(data.to(self.tensor.device))
