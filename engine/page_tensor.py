"""KV pages held in one tensor ``[num_layers, 2, num_blocks, *layout.slab_shape]``: the native
engine's cache (``native_engine/kv_cache.py`` adds the kernels' per-layer views) and a KV
store's pool (``kvstore_service/``). Block reads and writes only; who may touch which block, and
when, is the contract in ``kvtransfer/base.py``."""

from __future__ import annotations

import torch

from engine.dtypes import torch_dtype
from engine.kv_layout import KVCacheLayout
from engine.kv_pages import DenseKVPages, SlabSpans


class PageTensor(DenseKVPages):
    """Every layer's blocks in one tensor (``DenseKVPages`` for the transfer backends; NIXL
    registers the tensor whole)."""

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
