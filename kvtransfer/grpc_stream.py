"""gRPC streaming backend: the decode side calls ``KVTransfer.Pull`` on the prefill worker's KV
port and receives a header, then layer-major checksummed chunks (``kvtransfer.codec``).

The sender checks the receiver's layout before sending a byte (FAILED_PRECONDITION, naming both
layouts); the receiver checks the header against its own layout and every chunk's checksum, and
writes each layer into its cache as soon as the layer is complete.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from engine.kv_cache import KVCache
from kvtransfer.base import (
    BlockLeases,
    KVHandle,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferErrorCode,
    TransferStats,
    write_in_thread,
)
from kvtransfer.codec import DEFAULT_CHUNK_BYTES, LayerAssembler, iter_chunks, tensor_bytes
from pdserve.channels import ChannelPool
from pdserve.convert import layout_from_proto, layout_to_proto
from pdserve.server import GRPC_OPTIONS
from pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

_CODES = {
    grpc.StatusCode.FAILED_PRECONDITION: TransferErrorCode.LAYOUT_MISMATCH,
    grpc.StatusCode.NOT_FOUND: TransferErrorCode.NOT_FOUND,
    grpc.StatusCode.DATA_LOSS: TransferErrorCode.CORRUPTED,
}


class GrpcKVSender(KVSender, kv_transfer_pb2_grpc.KVTransferServicer):
    backend = "grpc"

    def __init__(
        self,
        cache: KVCache,
        leases: BlockLeases,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(cache, leases)
        self.host = host
        self.port = port
        self.chunk_bytes = chunk_bytes
        self._server: grpc.aio.Server | None = None
        self._address = ""

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        self._address = f"{self.host}:{port}"
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)

    async def Pull(
        self, request: kv_transfer_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_transfer_pb2.KVMessage]:
        mismatch = self.cache.layout.mismatch(layout_from_proto(request.receiver_layout))
        if mismatch is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        try:
            block_ids = self.leases.checkout(request.request_id)
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no lease for request_id {request.request_id!r}"
            )
        try:
            layout = self.cache.layout
            layer_bytes = layout.block_bytes // layout.num_layers * len(block_ids)
            yield kv_transfer_pb2.KVMessage(
                header=kv_transfer_pb2.KVHeader(
                    layout=layout_to_proto(layout),
                    num_blocks=len(block_ids),
                    total_bytes=layer_bytes * layout.num_layers,
                    layer_bytes=layer_bytes,
                )
            )
            chunks = iter_chunks(
                lambda layer: tensor_bytes(self.cache.read_layer(layer, block_ids)),
                layout.num_layers,
                self.chunk_bytes,
            )
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield kv_transfer_pb2.KVMessage(
                    chunk=kv_transfer_pb2.KVChunk(
                        offset=chunk.offset, data=chunk.data, crc32=chunk.crc32
                    )
                )
        finally:
            await self.leases.checkin(request.request_id)


class GrpcKVReceiver(KVReceiver):
    backend = "grpc"

    def __init__(self, cache: KVCache, timeout_s: float = 60.0) -> None:
        super().__init__(cache)
        self.timeout_s = timeout_s
        self._channels = ChannelPool()

    async def close(self) -> None:
        await self._channels.close()

    async def pull(self, handle: KVHandle, block_ids: list[int]) -> TransferStats:
        self.check_handle(handle, block_ids)
        start = time.perf_counter()
        request = kv_transfer_pb2.PullRequest(
            request_id=handle.request_id, receiver_layout=layout_to_proto(self.cache.layout)
        )
        call = kv_transfer_pb2_grpc.KVTransferStub(self._channels.get(handle.address)).Pull(
            request, timeout=self.timeout_s
        )
        try:
            num_bytes = await self._receive(call, handle, block_ids)
        except grpc.aio.AioRpcError as exc:
            code = _CODES.get(exc.code(), TransferErrorCode.UNAVAILABLE)
            raise KVTransferError(code, f"{handle.address}: {exc.details()}") from None
        finally:
            call.cancel()
        return TransferStats(num_bytes, time.perf_counter() - start)

    async def _receive(
        self,
        call: grpc.aio.UnaryStreamCall[kv_transfer_pb2.PullRequest, kv_transfer_pb2.KVMessage],
        handle: KVHandle,
        block_ids: list[int],
    ) -> int:
        assembler: LayerAssembler | None = None
        async for message in call:
            if message.HasField("header"):
                assembler = self._check_header(message.header, handle)
                continue
            if assembler is None:
                raise KVTransferError(TransferErrorCode.CORRUPTED, "chunk before header")
            chunk = message.chunk
            for layer, data in assembler.add(chunk.offset, chunk.data, chunk.crc32):
                # One layer at a time: the next chunks queue in gRPC while this one is written.
                await write_in_thread(self.cache.write_layer, layer, block_ids, data)
        if assembler is None or not assembler.complete:
            raise KVTransferError(TransferErrorCode.CORRUPTED, "stream ended before all layers")
        return assembler.total_bytes

    def _check_header(self, header: kv_transfer_pb2.KVHeader, handle: KVHandle) -> LayerAssembler:
        mismatch = self.cache.layout.mismatch(layout_from_proto(header.layout))
        if mismatch is not None:
            raise KVTransferError(TransferErrorCode.LAYOUT_MISMATCH, mismatch)
        if header.num_blocks != handle.num_blocks:
            raise KVTransferError(
                TransferErrorCode.CORRUPTED,
                f"sender has {header.num_blocks} blocks, handle says {handle.num_blocks}",
            )
        assembler = LayerAssembler(self.cache.layout, handle.num_blocks)
        if (header.total_bytes, header.layer_bytes) != (
            assembler.total_bytes,
            assembler.layer_bytes,
        ):
            raise KVTransferError(
                TransferErrorCode.CORRUPTED,
                f"header sizes {header.total_bytes}/{header.layer_bytes} bytes, expected "
                f"{assembler.total_bytes}/{assembler.layer_bytes}",
            )
        return assembler
