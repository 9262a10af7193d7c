"""A paged KV cache as the KV transfer backends see it: blocks of opaque slabs.

A block's keys (or values) in one layer are one *slab* of ``layout.slab_block_bytes`` bytes; the
slabs of a transfer go layer-major (slab ``layer * 2 + kv``). What the bytes of a slab mean is the
engine's business: the transfer backends copy them and never look inside, and the layout
(``KVCacheLayout.page_layout``) names the arrangement so that two engines whose slabs mean
different things are refused before any block moves.

Implemented by the native engine's ``KVCache`` (one tensor) and by the vLLM engine's view of its
per-layer pages (``vllm_engine.kv_pages``). Who may read or write which block, and when, is the
contract in ``kvtransfer/base.py``: these methods only copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_layout import KVCacheLayout
from engine.kv_shards import head_range

if TYPE_CHECKING:
    import torch


# A destination block id a pull receives but does not write: a block the engine already holds
# (vLLM's own prefix hit, shared with other requests). Only pages that hold such blocks get it.
SKIP_BLOCK = -1


@dataclass(frozen=True)
class SlabSpans:
    """Where the pages' bytes lie, for one-sided reads (NIXL: ``kvtransfer/nixl_plan.py``):
    slab ``s`` (``layer * 2 + kv``) of block ``b`` is ``layout.slab_block_bytes`` contiguous
    bytes at ``bases[s] + b * strides[s]``, inside ``tensors`` (what an agent registers)."""

    tensors: tuple[torch.Tensor, ...]
    bases: tuple[int, ...]
    strides: tuple[int, ...]
    device_id: int = 0  # the CUDA device, 0 on the host

    @property
    def on_device(self) -> bool:
        return self.tensors[0].device.type == "cuda"


class KVPages(ABC):
    layout: KVCacheLayout
    num_blocks: int

    @abstractmethod
    def read_slabs(self, first: int, num_slabs: int, block_ids: list[int]) -> torch.Tensor:
        """Slabs ``first .. first + num_slabs - 1`` of the given blocks:
        ``[num_slabs, n, *layout.slab_shape]`` of ``layout.storage_dtype``, a contiguous copy."""

    @abstractmethod
    def write_slabs(self, first: int, block_ids: list[int], data: torch.Tensor) -> None:
        """``data``: ``[num_slabs, n, *layout.slab_shape]`` for slabs ``first`` onwards, as
        ``read_slabs`` returned it (on any engine with the same layout)."""

    def shard(self, layout: KVCacheLayout) -> KVPages:
        """The pages holding ``layout``, one read's shard (``engine.kv_shards``): these pages
        when it is theirs, else a view of the heads that hold it (writes through it land in
        these pages). Raises ``ValueError`` naming why they hold no such shard."""
        first, count = head_range(self.layout, layout)
        if (first, count) == (0, self.layout.num_kv_heads):
            return self
        return self.heads(first, layout)

    def heads(self, first: int, layout: KVCacheLayout) -> KVPages:
        """A view of heads ``[first, first + layout.num_kv_heads)`` of every page, whose layout
        is ``layout`` (``shard`` checked it). Pages whose slabs cannot be cut by heads refuse."""
        raise ValueError(
            f"these KV pages ({self.layout.page_layout}) are not cut by heads: KV moves only "
            "between engines of the same tensor parallelism"
        )

    def spans(self) -> SlabSpans:
        """Where each slab lies (for NIXL). Pages that cannot say refuse by name."""
        raise ValueError(f"these KV pages ({self.layout.page_layout}) have no one-sided spans")

    def read_slab(self, layer: int, kv: int, block_ids: list[int]) -> torch.Tensor:
        """Keys (kv 0) or values (kv 1) of one layer: ``[n, *slab_shape]``."""
        check_kv(kv)
        return self.read_slabs(layer * 2 + kv, 1, block_ids)[0]

    def write_slab(self, layer: int, kv: int, block_ids: list[int], data: torch.Tensor) -> None:
        check_kv(kv)
        self.write_slabs(layer * 2 + kv, block_ids, data[None])

    def read_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """``[2, n, *slab_shape]``: both slabs of one layer, a contiguous copy."""
        return self.read_slabs(layer * 2, 2, block_ids)

    def write_layer(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        self.write_slabs(layer * 2, block_ids, data)

    def check_block_ids(self, block_ids: list[int]) -> None:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block_ids out of range [0, {self.num_blocks}): {block_ids}")

    def check_slabs(self, first: int, num_slabs: int) -> None:
        total = 2 * self.layout.num_layers
        if not (first >= 0 and num_slabs >= 1 and first + num_slabs <= total):
            raise ValueError(f"slabs [{first}, {first + num_slabs}) out of range [0, {total})")


class DenseKVPages(KVPages):
    """Pages held in one tensor ``[num_layers, 2, num_blocks, *layout.slab_shape]`` of
    ``layout.storage_dtype`` (the native engine's cache, ``native_engine.kv_cache``): what a
    backend that copies whole layer ranges at once (Ray's object store) and the in-place
    digest read. ``words``: the same tensor as block copies move it (int32 words when the
    cache is quantized)."""

    tensor: torch.Tensor
    words: torch.Tensor


def check_kv(kv: int) -> None:
    if kv not in (0, 1):
        raise ValueError(f"kv must be 0 (keys) or 1 (values), got {kv}")
