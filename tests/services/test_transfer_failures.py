"""Transfer failures through the real services: the decode worker reports a clean status and
both sides end with every block free."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from engine import SamplingParams
from engine.kv_layout import KVCacheDtype
from engine.kv_pages import KVPages
from kvtransfer.codec import ChunkSpec
from kvtransfer.grpc_stream import GrpcKVSender
from kvtransfer.nixl_sender import NixlKVSender
from pdserve.common.convert import layout_to_proto
from pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, nixl_pb2
from tests.services.harness import (
    both_sides_freed,
    failed_decode,
    start_decode,
    start_prefill,
)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 300))


def test_corrupted_chunk_fails_cleanly_and_frees_both_sides(llama_dir: Path) -> None:
    async def run() -> None:
        prefill, prefill_server = await start_prefill(llama_dir)
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        sender = prefill._sender
        assert isinstance(sender, GrpcKVSender)
        sender.chunk_bytes = 4096  # small chunks, so that the stream has a second one to damage
        encode, sent = sender._encode, [0]

        def damaged(
            pages: KVPages, spec: ChunkSpec, block_ids: list[int]
        ) -> kv_transfer_pb2.KVMessage:
            # A faulty NIC or memory: one bit flips after the checksum was taken.
            message = encode(pages, spec, block_ids)
            sent[0] += 1
            if sent[0] == 2:
                data = bytearray(message.chunk.data)
                data[len(data) // 2] ^= 0x10
                message.chunk.data = bytes(data)
            return message

        sender._encode = damaged  # type: ignore[method-assign]
        try:
            error = await failed_decode(prefill_server, decode_server, PROMPT, PARAMS)
            assert error.code() == grpc.StatusCode.DATA_LOSS
            assert "checksum mismatch" in (error.details() or "")
            await both_sides_freed(prefill_server, decode_server)
        finally:
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())


def test_a_flipped_bit_after_the_nixl_digest_is_data_loss_and_frees_both_sides(
    llama_dir: Path,
) -> None:
    async def run() -> None:
        prefill, prefill_server = await start_prefill(llama_dir, kv_backend="nixl")
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server], kv_backend="nixl")
        sender = prefill._sender
        assert isinstance(sender, NixlKVSender)
        checkout = sender.checkout

        async def damaged(
            request: nixl_pb2.NixlCheckoutRequest, context: grpc.aio.ServicerContext
        ) -> nixl_pb2.NixlCheckoutResponse:
            # Faulty memory: one bit of a leased block flips after its digest was taken, so
            # the one-sided READ carries it (no checksum of its own).
            response = await checkout(request, context)
            block = response.block_ids[len(response.block_ids) // 2]
            prefill.engine.kv_cache.tensor[1, 0, block].view(torch.uint8)[7] ^= 0x10
            return response

        sender.checkout = damaged  # type: ignore[method-assign]
        try:
            error = await failed_decode(prefill_server, decode_server, PROMPT, PARAMS)
            assert error.code() == grpc.StatusCode.DATA_LOSS
            assert "differ from the sender's digest" in (error.details() or "")
            await both_sides_freed(prefill_server, decode_server)
        finally:
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())


# A decode worker whose KV layout differs from the sender's in one field, and what the refusal
# must name: both layouts, and the field.
MISMATCHES = [
    ({"block_size": 8}, ["block_size=8", "block_size=16"]),
    ({"kv_cache_dtype": KVCacheDtype.INT8}, ["kv_cache_dtype int8 != auto"]),
]


@pytest.mark.parametrize(("differs", "named"), MISMATCHES, ids=["block_size", "kv_cache_dtype"])
def test_layout_mismatch_is_failed_precondition_and_frees_both_sides(
    differs: dict[str, object], named: list[str], llama_dir: Path
) -> None:
    async def run() -> None:
        _, prefill_server = await start_prefill(llama_dir)
        _, decode_server = await start_decode(
            llama_dir,
            peers=[prefill_server],
            **differs,  # type: ignore[arg-type]
        )
        try:
            error = await failed_decode(prefill_server, decode_server, PROMPT, PARAMS)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = error.details() or ""
            for text in ["local layout", "remote layout", *named]:
                assert text in details, (text, details)
            await both_sides_freed(prefill_server, decode_server)
        finally:
            await decode_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())


def test_sender_refuses_a_mismatched_receiver_layout(llama_dir: Path) -> None:
    async def run() -> None:
        prefill, prefill_server = await start_prefill(llama_dir)
        try:
            layout = prefill.engine.kv_layout
            wrong = layout_to_proto(layout)
            wrong.head_dim = layout.head_dim * 2
            sender = prefill._sender.address  # type: ignore[union-attr]
            async with grpc.aio.insecure_channel(sender) as channel:
                stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Pull(
                        kv_transfer_pb2.PullRequest(request_id="x", receiver_layout=wrong)
                    ):
                        pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"head_dim={layout.head_dim * 2}" in (err.value.details() or "")
        finally:
            await prefill_server.shutdown()

    asyncio.run(run())
