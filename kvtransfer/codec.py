"""The chunking of a gRPC KV transfer: block-aligned slabs, layer-major, each checksummed.

A chunk is the keys or the values of one layer for a run of the request's blocks, sized to about
``chunk_bytes`` (at least one block). Block-aligned chunks let the receiver copy each straight
into its destination blocks: no reassembly buffer, and a layer is written as soon as it arrives.
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass

import torch

from engine.kv_cache import torch_dtype
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


def blocks_per_chunk(layout: KVCacheLayout, chunk_bytes: int) -> int:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    return max(1, chunk_bytes // layout.slab_block_bytes)


def plan_chunks(layout: KVCacheLayout, num_blocks: int, per_chunk: int) -> list[ChunkSpec]:
    """Every chunk of a transfer, in wire order."""
    if per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {per_chunk}")
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
    checksum; returns it as a tensor ``[n, *layout.slab_shape]`` over ``data``."""

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
        if len(data) != spec.num_blocks * self.layout.slab_block_bytes:
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
        shape = (spec.num_blocks, *layout.slab_shape)
        return raw.view(torch_dtype(layout.storage_dtype)).reshape(shape)
