"""The byte stream of a KV transfer: layer-major, cut into checksummed chunks.

Stream = ``[num_layers][2 (k|v)][num_blocks][block_size][num_kv_heads][head_dim]`` raw bytes in
the cache dtype. Chunks are slices of that stream (``chunk_bytes`` each, the last one shorter),
so they may span layers; the receiver writes each layer as soon as its bytes are all in, while
later layers are still on the wire.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCacheLayout, torch_dtype
from kvtransfer.base import KVTransferError, TransferErrorCode

DEFAULT_CHUNK_BYTES = 4 << 20


def checksum(data: bytes | memoryview) -> int:
    return zlib.crc32(data)


def layer_bytes(layout: KVCacheLayout, num_blocks: int) -> int:
    """Bytes of one layer's K and V for ``num_blocks`` blocks."""
    return layout.block_bytes // layout.num_layers * num_blocks


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A read-only byte view of a tensor (copied to host memory first if needed)."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy().data


@dataclass(frozen=True)
class Chunk:
    offset: int
    data: bytes
    crc32: int


def iter_chunks(
    read_layer: Callable[[int], memoryview], num_layers: int, chunk_bytes: int
) -> Iterator[Chunk]:
    """Chunks of the layer-major stream. ``read_layer`` is called lazily, one layer at a time."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    offset = 0
    pending: list[memoryview] = []
    num_pending = 0
    for layer in range(num_layers):
        view = read_layer(layer)
        start = 0
        while start < len(view):
            take = min(chunk_bytes - num_pending, len(view) - start)
            pending.append(view[start : start + take])
            num_pending += take
            start += take
            if num_pending == chunk_bytes:
                data = b"".join(pending)
                yield Chunk(offset, data, checksum(data))
                offset += num_pending
                pending, num_pending = [], 0
    if num_pending:
        data = b"".join(pending)
        yield Chunk(offset, data, checksum(data))


class LayerAssembler:
    """Receiver side: checks chunks (order, bounds, checksum) and hands out completed layers as
    tensors ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` backed by its buffer."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.layer_bytes = layer_bytes(layout, num_blocks)
        self.total_bytes = self.layer_bytes * layout.num_layers
        self._buffer = bytearray(self.total_bytes)
        self._received = 0
        self._next_layer = 0

    @property
    def complete(self) -> bool:
        return self._received == self.total_bytes

    def add(self, offset: int, data: bytes, crc32: int) -> list[tuple[int, torch.Tensor]]:
        """Returns the layers this chunk completed (usually none or one)."""
        if offset != self._received:
            raise KVTransferError(
                TransferErrorCode.CORRUPTED, f"chunk at offset {offset}, expected {self._received}"
            )
        end = offset + len(data)
        if end > self.total_bytes:
            raise KVTransferError(
                TransferErrorCode.CORRUPTED,
                f"chunk ends at byte {end}, past the stream's {self.total_bytes} bytes",
            )
        if checksum(data) != crc32:
            raise KVTransferError(
                TransferErrorCode.CORRUPTED, f"checksum mismatch in chunk at offset {offset}"
            )
        self._buffer[offset:end] = data
        self._received = end
        done = []
        while (
            self._next_layer < self.layout.num_layers
            and (self._next_layer + 1) * self.layer_bytes <= self._received
        ):
            done.append((self._next_layer, self._layer(self._next_layer)))
            self._next_layer += 1
        return done

    def _layer(self, layer: int) -> torch.Tensor:
        start = layer * self.layer_bytes
        view = memoryview(self._buffer)[start : start + self.layer_bytes]
        shape = (
            2,
            self.num_blocks,
            self.layout.block_size,
            self.layout.num_kv_heads,
            self.layout.head_dim,
        )
        raw = torch.frombuffer(view, dtype=torch.uint8)
        return raw.view(torch_dtype(self.layout.dtype)).reshape(shape)
