"""The chunking of a gRPC KV transfer: block-aligned slabs, layer-major, each checksummed.

A chunk is the keys or the values of one layer for a run of the request's blocks, sized to about
``chunk_bytes`` (at least one block). Block-aligned chunks let the receiver copy each straight
into its destination blocks: no reassembly buffer, and a layer is written as soon as it arrives.
When one such slab of the request is smaller than ``chunk_bytes`` (a small model, a short
prompt, a quantized cache), a chunk carries several consecutive slabs whole, in the same
layer-major order: each chunk costs a fixed ~1 ms (two thread hops, a gRPC message), which would
otherwise dominate a short transfer.
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass

import torch

from engine.dtypes import torch_dtype
from engine.kv_layout import KVCacheLayout
from kvtransfer.base import KVTransferError, TransferErrorCode

DEFAULT_CHUNK_BYTES = 4 << 20


def checksum(data: bytes) -> int:
    return zlib.crc32(data)


@dataclass(frozen=True)
class ChunkSpec:
    layer: int
    kv: int  # 0: keys, 1: values
    first_block: int  # index into the request's block list
    num_blocks: int
    # Consecutive slabs from (layer, kv), layer-major (layer * 2 + kv onwards), each whole
    # (first_block 0, every block of the request) when more than one.
    num_slabs: int = 1

    @property
    def slab(self) -> int:
        return self.layer * 2 + self.kv


def blocks_per_chunk(layout: KVCacheLayout, chunk_bytes: int) -> int:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    return max(1, chunk_bytes // layout.slab_block_bytes)


# What a receiver advertises (PullRequest.max_slabs_per_chunk): every slab of any layout.
MAX_SLABS_PER_CHUNK = 1 << 16


def slabs_per_chunk(
    layout: KVCacheLayout, num_blocks: int, chunk_bytes: int, receiver_max: int
) -> int:
    """How many whole slabs of a ``num_blocks`` request fit one chunk (1 when fewer than two
    do), at most what the receiver takes."""
    whole = chunk_bytes // (max(num_blocks, 1) * layout.slab_block_bytes)
    return max(1, min(2 * layout.num_layers, whole, receiver_max))


def plan_chunks(
    layout: KVCacheLayout, num_blocks: int, per_chunk: int, num_slabs: int = 1
) -> list[ChunkSpec]:
    """Every chunk of a transfer, in wire order: ``num_slabs`` whole slabs per chunk when more
    than one (which needs ``per_chunk >= num_blocks``), else runs of ``per_chunk`` blocks."""
    if per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {per_chunk}")
    total = 2 * layout.num_layers
    if not 1 <= num_slabs <= total:
        raise ValueError(f"slabs_per_chunk must be in [1, {total}], got {num_slabs}")
    if num_slabs > 1 and per_chunk < num_blocks:
        raise ValueError(
            f"slabs_per_chunk {num_slabs} needs whole slabs: blocks_per_chunk {per_chunk} < "
            f"{num_blocks} blocks"
        )
    if num_slabs > 1:
        return [
            ChunkSpec(s // 2, s % 2, 0, num_blocks, min(num_slabs, total - s))
            for s in range(0, total, num_slabs)
        ]
    return [
        ChunkSpec(layer, kv, first, min(per_chunk, num_blocks - first))
        for layer in range(layout.num_layers)
        for kv in (0, 1)
        for first in range(0, num_blocks, per_chunk)
    ]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy().tobytes()


class ChunkChecker:
    """Receiver side: each chunk must be the next one planned, of the right size, and match its
    checksum; returns it as a tensor ``[num_slabs, n, *layout.slab_shape]`` over ``data``."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int, plan: list[ChunkSpec]) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self._plan = plan
        self._next = 0
        self.num_bytes = 0

    @property
    def complete(self) -> bool:
        return self._next == len(self._plan)

    def check(self, spec: ChunkSpec, data: bytes, crc32: int) -> torch.Tensor:
        if self._next >= len(self._plan) or spec != self._plan[self._next]:
            expected = self._plan[self._next] if not self.complete else "end of stream"
            raise KVTransferError(
                TransferErrorCode.CORRUPTED, f"got chunk {spec}, expected {expected}"
            )
        if len(data) != spec.num_slabs * spec.num_blocks * self.layout.slab_block_bytes:
            raise KVTransferError(
                TransferErrorCode.CORRUPTED, f"chunk {spec} has {len(data)} bytes"
            )
        if checksum(data) != crc32:
            raise KVTransferError(TransferErrorCode.CORRUPTED, f"checksum mismatch in chunk {spec}")
        self._next += 1
        self.num_bytes += len(data)
        layout = self.layout
        with warnings.catch_warnings():
            # Read-only view of the message bytes; the cache copy is the only write.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        shape = (spec.num_slabs, spec.num_blocks, *layout.slab_shape)
        return raw.view(torch_dtype(layout.storage_dtype)).reshape(shape)
