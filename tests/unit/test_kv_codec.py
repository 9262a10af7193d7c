"""The KV stream codec: layer-major chunks round-trip exactly; damage is detected."""

from __future__ import annotations

import pytest
import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import KVTransferError, TransferErrorCode
from kvtransfer.codec import LayerAssembler, iter_chunks, layer_bytes, tensor_bytes

LAYOUT = KVCacheLayout("fp", "float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def _layers(num_blocks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, num_blocks, 4, 2, 8, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("chunk_bytes", [100, 768, 1536, 10_000])
def test_round_trip_any_chunking(chunk_bytes: int) -> None:
    layers = _layers(num_blocks=3)
    assert layer_bytes(LAYOUT, 3) == layers[0].numel() * 4 == 1536
    assembler = LayerAssembler(LAYOUT, 3)
    got: dict[int, torch.Tensor] = {}
    chunks = list(iter_chunks(lambda i: tensor_bytes(layers[i]), 3, chunk_bytes))
    assert all(len(c.data) == chunk_bytes for c in chunks[:-1])
    for chunk in chunks:
        for layer, data in assembler.add(chunk.offset, chunk.data, chunk.crc32):
            got[layer] = data.clone()
    assert assembler.complete
    assert sorted(got) == [0, 1, 2]
    for i in range(3):
        assert torch.equal(got[i], layers[i])


def test_layers_complete_as_bytes_arrive() -> None:
    layers = _layers(num_blocks=1)  # 512 bytes per layer
    assembler = LayerAssembler(LAYOUT, 1)
    chunks = list(iter_chunks(lambda i: tensor_bytes(layers[i]), 3, 384))
    completed = [[layer for layer, _ in assembler.add(c.offset, c.data, c.crc32)] for c in chunks]
    assert completed == [[], [0], [1], [2]]


def test_corrupted_chunk_detected() -> None:
    layers = _layers(num_blocks=1)
    chunk = next(iter_chunks(lambda i: tensor_bytes(layers[i]), 3, 256))
    damaged = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
    with pytest.raises(KVTransferError) as err:
        LayerAssembler(LAYOUT, 1).add(chunk.offset, damaged, chunk.crc32)
    assert err.value.code is TransferErrorCode.CORRUPTED
    assert "checksum" in str(err.value)


def test_out_of_order_and_overlong_chunks_detected() -> None:
    assembler = LayerAssembler(LAYOUT, 1)
    data = b"\0" * 16
    from kvtransfer.codec import checksum

    with pytest.raises(KVTransferError, match="offset 16, expected 0"):
        assembler.add(16, data, checksum(data))
    too_long = b"\0" * (assembler.total_bytes + 1)
    with pytest.raises(KVTransferError, match="past the stream"):
        assembler.add(0, too_long, checksum(too_long))
