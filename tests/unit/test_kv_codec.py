"""The KV chunk codec: exact chunk plans, lossless round trip into other blocks, damage detected."""

from __future__ import annotations

import pytest
import torch

from engine.kv_layout import KVCacheDtype, KVCacheLayout
from kvtransfer import KVTransferError, TransferErrorCode
from kvtransfer.base import KVHandle
from kvtransfer.codec import (
    MAX_SLABS_PER_CHUNK,
    ChunkChecker,
    ChunkSpec,
    blocks_per_chunk,
    checksum,
    plan_chunks,
    slabs_per_chunk,
    tensor_bytes,
)
from kvtransfer.grpc_stream import GrpcKVReceiver
from native_engine.kv_cache import KVCache
from pdserve.common.convert import layout_to_proto
from pdserve.v1 import kv_transfer_pb2

LAYOUT = KVCacheLayout("fp", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def test_plan_is_layer_major_and_block_aligned() -> None:
    assert LAYOUT.slab_block_bytes == 4 * 2 * 8 * 4 == 256
    per_chunk = blocks_per_chunk(LAYOUT, chunk_bytes=600)
    assert per_chunk == 2
    assert plan_chunks(LAYOUT, 3, per_chunk) == [
        ChunkSpec(0, 0, 0, 2), ChunkSpec(0, 0, 2, 1), ChunkSpec(0, 1, 0, 2), ChunkSpec(0, 1, 2, 1),
        ChunkSpec(1, 0, 0, 2), ChunkSpec(1, 0, 2, 1), ChunkSpec(1, 1, 0, 2), ChunkSpec(1, 1, 2, 1),
    ]  # fmt: skip
    assert blocks_per_chunk(LAYOUT, chunk_bytes=10) == 1  # never less than a block


@pytest.mark.parametrize("chunk_bytes", [1, 512, 1 << 20])
def test_round_trip_into_other_blocks(chunk_bytes: int) -> None:
    source = KVCache(LAYOUT, 8, torch.device("cpu"))
    source.tensor.copy_(
        torch.randn(source.tensor.shape, generator=torch.Generator().manual_seed(0))
    )
    dest = KVCache(LAYOUT, 8, torch.device("cpu"))
    src_ids, dst_ids = [5, 1, 6], [0, 7, 3]
    plan = plan_chunks(LAYOUT, 3, blocks_per_chunk(LAYOUT, chunk_bytes))
    checker = ChunkChecker(LAYOUT, 3, plan)
    for spec in plan:
        part = slice(spec.first_block, spec.first_block + spec.num_blocks)
        data = tensor_bytes(source.read_slab(spec.layer, spec.kv, src_ids[part]))
        slab = checker.check(spec, data, checksum(data))
        dest.write_slabs(spec.slab, dst_ids[part], slab)
    assert checker.complete and checker.num_bytes == 3 * LAYOUT.block_bytes
    for layer in range(2):
        assert torch.equal(dest.read_layer(layer, dst_ids), source.read_layer(layer, src_ids))
    assert not dest.tensor[:, :, [1, 2, 4, 5, 6]].any()  # nothing written elsewhere


def _first_chunk() -> tuple[ChunkChecker, ChunkSpec, bytes]:
    plan = plan_chunks(LAYOUT, 1, 1)
    data = bytes(range(256))
    return ChunkChecker(LAYOUT, 1, plan), plan[0], data


def test_corrupted_chunk_detected() -> None:
    checker, spec, data = _first_chunk()
    damaged = bytes([data[0] ^ 1]) + data[1:]
    with pytest.raises(KVTransferError) as err:
        checker.check(spec, damaged, checksum(data))
    assert err.value.code is TransferErrorCode.CORRUPTED
    assert "checksum mismatch" in str(err.value)


def test_out_of_order_and_wrong_size_chunks_detected() -> None:
    checker, spec, data = _first_chunk()
    with pytest.raises(KVTransferError, match="expected ChunkSpec"):
        checker.check(ChunkSpec(0, 1, 0, 1), data, checksum(data))
    with pytest.raises(KVTransferError, match="has 255 bytes"):
        checker.check(spec, data[:-1], checksum(data[:-1]))
    assert not checker.complete


def test_small_requests_carry_several_whole_slabs_per_chunk() -> None:
    """A request's slab smaller than half a chunk: whole slabs, layer-major, a short last chunk;
    never more than the receiver takes (an older receiver advertises nothing: one)."""
    assert slabs_per_chunk(LAYOUT, 1, 700, MAX_SLABS_PER_CHUNK) == 2  # 256 bytes per slab
    assert slabs_per_chunk(LAYOUT, 1, 1 << 20, MAX_SLABS_PER_CHUNK) == 4  # all there are
    assert slabs_per_chunk(LAYOUT, 1, 1 << 20, 1) == 1
    assert slabs_per_chunk(LAYOUT, 3, 600, MAX_SLABS_PER_CHUNK) == 1
    assert plan_chunks(LAYOUT, 1, 2, 3) == [ChunkSpec(0, 0, 0, 1, 3), ChunkSpec(1, 1, 0, 1, 1)]


@pytest.mark.parametrize(
    ("blocks_per_chunk_", "slabs", "named"),
    [
        (2, 2, "needs whole slabs: blocks_per_chunk 2 < 3 blocks"),
        (3, 5, "slabs_per_chunk must be in [1, 4], got 5"),
        (3, 1 << 31, "slabs_per_chunk must be in [1, 4]"),
        (0, 1, "0 blocks per chunk"),
    ],
)
def test_a_garbled_header_is_refused_by_name(
    blocks_per_chunk_: int, slabs: int, named: str
) -> None:
    """What a receiver does with a sender's header: a named CORRUPTED, before any write."""
    receiver = GrpcKVReceiver(KVCache(LAYOUT, 4, torch.device("cpu")))
    header = kv_transfer_pb2.KVHeader(
        layout=layout_to_proto(LAYOUT),
        num_blocks=3,
        blocks_per_chunk=blocks_per_chunk_,
        slabs_per_chunk=slabs,
        total_bytes=3 * LAYOUT.block_bytes,
    )
    handle = KVHandle("grpc", "127.0.0.1:1", "r", 3, LAYOUT, 30.0)
    with pytest.raises(KVTransferError) as err:
        receiver._check_header(header, handle)
    assert err.value.code is TransferErrorCode.CORRUPTED and named in str(err.value)


@pytest.mark.parametrize("kind", [KVCacheDtype.AUTO, KVCacheDtype.INT8])
def test_multi_slab_round_trip_into_other_blocks(kind: KVCacheDtype) -> None:
    layout = KVCacheLayout("fp", "float32", 4, 3, 2, 8, kind)
    source, dest = (KVCache(layout, 8, torch.device("cpu")) for _ in range(2))
    source.words.random_(generator=torch.Generator().manual_seed(1))
    src_ids, dst_ids = [5, 1], [0, 7]
    num_slabs = slabs_per_chunk(layout, 2, 4 * 2 * layout.slab_block_bytes, MAX_SLABS_PER_CHUNK)
    plan = plan_chunks(layout, 2, blocks_per_chunk(layout, 1 << 20), num_slabs)
    assert [spec.num_slabs for spec in plan] == [4, 2]
    checker = ChunkChecker(layout, 2, plan)
    for spec in plan:
        data = tensor_bytes(source.read_slabs(spec.slab, spec.num_slabs, src_ids))
        dest.write_slabs(spec.slab, dst_ids, checker.check(spec, data, checksum(data)))
    assert checker.complete and checker.num_bytes == 2 * layout.block_bytes
    assert torch.equal(dest.read_blocks(dst_ids), source.read_blocks(src_ids))
    assert not dest.words[:, :, [1, 2, 3, 4, 5, 6]].any()
