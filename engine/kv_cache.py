"""The paged KV cache: one preallocated tensor, plus block-level reads and writes.

Layout: ``[num_layers, 2 (k|v), num_blocks, block_size, num_kv_heads, head_dim]``. Layer-major,
so one layer's blocks can be read, shipped and written while the next layer is in flight, and
``tensor[layer, 0]`` is a contiguous per-layer key cache for the kernels.
"""

from __future__ import annotations

import torch

from engine.kv_layout import KVCacheLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["KVCache", "KVCacheLayout", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class KVCache:
    def __init__(self, layout: KVCacheLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(
            layout.num_layers,
            2,
            num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=_DTYPES[layout.dtype],
            device=device,
        )

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block_ids out of range [0, {self.num_blocks}): {block_ids}")
        return torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)

    def read_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """``[2, num_blocks, block_size, num_kv_heads, head_dim]``, a contiguous copy."""
        return self.tensor[layer][:, self._index(block_ids)]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Every layer of the given blocks:
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, a contiguous copy."""
        return self.tensor.index_select(2, self._index(block_ids))

    def read_slab(self, layer: int, kv: int, block_ids: list[int]) -> torch.Tensor:
        """Keys (kv 0) or values (kv 1) of one layer: ``[n, block_size, heads, head_dim]``."""
        return self.tensor[layer, kv].index_select(0, self._index(block_ids))

    def write_slab(self, layer: int, kv: int, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (len(block_ids), *self.tensor.shape[3:])
        if tuple(data.shape) != expected or data.dtype != self.tensor.dtype:
            raise ValueError(
                f"slab data has shape {tuple(data.shape)} {data.dtype}, "
                f"expected {expected} {self.tensor.dtype}"
            )
        self.tensor[layer, kv].index_copy_(0, self._index(block_ids), data.to(self.tensor.device))

    def write_layer(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (2, len(block_ids), *self.tensor.shape[3:])
        if tuple(data.shape) != expected or data.dtype != self.tensor.dtype:
            raise ValueError(
                f"layer data has shape {tuple(data.shape)} {data.dtype}, "
                f"expected {expected} {self.tensor.dtype}"
            )
        self.tensor[layer][:, self._index(block_ids)] = data.to(self.tensor.device)
