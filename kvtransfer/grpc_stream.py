"""gRPC streaming backend: the decode side calls ``KVTransfer.Pull`` on the prefill worker's KV
port and receives a header, then layer-major checksummed chunks (``kvtransfer.codec``).

The sender checks the receiver's layout before sending a byte (FAILED_PRECONDITION, naming both
layouts): it sends the shard that layout names, its pages or a head range of them (tensor
parallelism of another size: ``engine/kv_shards.py``); the receiver checks the header against
its own layout and every chunk's checksum, and writes each layer into its cache as soon as the
layer is complete.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from engine.kv_pages import KVPages
from engine.threads import finish_in_thread, transfer_executor
from kvtransfer.base import (
    BlockLeases,
    KVHandle,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferErrorCode,
    TransferStats,
)
from kvtransfer.codec import (
    DEFAULT_CHUNK_BYTES,
    MAX_SLABS_PER_CHUNK,
    ChunkChecker,
    ChunkSpec,
    blocks_per_chunk,
    checksum,
    plan_chunks,
    slabs_per_chunk,
    tensor_bytes,
)
from pdserve.common import peer_token, tracing
from pdserve.common.channels import SERVER_OPTIONS, TRANSFER_OPTIONS, ChannelPool
from pdserve.common.convert import layout_from_proto, layout_to_proto, remote_layout_mismatch
from pdserve.common.tls import TlsConfig, add_port
from pdserve.common.tracing import TraceContext
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
        cache: KVPages,
        leases: BlockLeases,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        advertise_host: str | None = None,
        tls: TlsConfig | None = None,
        max_pull_s: float = 60.0,
    ) -> None:
        super().__init__(cache, leases)
        self.host = host
        self.port = port
        self.advertise_host = advertise_host or host
        self.chunk_bytes = chunk_bytes
        self.tls = tls
        # A puller that stops reading must not pin the blocks past their lease: past this,
        # its checkout ends and the lease rules apply again.
        self.max_pull_s = max_pull_s
        self._server: grpc.aio.Server | None = None
        self._address = ""

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        interceptors = peer_token.server_interceptors()  # the cluster's token, if any
        self._server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(self, self._server)
        port = add_port(self._server, f"{self.host}:{self.port}", self.tls)
        self._address = f"{self.advertise_host}:{port}"
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)

    async def Pull(  # type: ignore[override]  # writes with context.write, bounded in time
        self, request: kv_transfer_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            wanted = layout_from_proto(request.receiver_layout)
        except ValueError as exc:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"remote layout refused: {exc}"
            )
        try:  # the receiver's layout names the shard it reads (engine/kv_shards.py)
            pages = self.cache.shard(wanted)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            trace = tracing.headers(context.invocation_metadata())
            read = await self.begin_read(request.request_id, request.lease_token, trace)
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no lease for request_id {request.request_id!r}"
            )
        block_ids = read.block_ids
        deadline = asyncio.get_running_loop().time() + self.max_pull_s
        try:
            layout = pages.layout
            per_chunk = blocks_per_chunk(layout, self.chunk_bytes)
            num_slabs = slabs_per_chunk(
                layout, len(block_ids), self.chunk_bytes, request.max_slabs_per_chunk or 1
            )
            plan = plan_chunks(layout, len(block_ids), per_chunk, num_slabs)
            header = kv_transfer_pb2.KVHeader(
                layout=layout_to_proto(layout),
                num_blocks=len(block_ids),
                blocks_per_chunk=per_chunk,
                slabs_per_chunk=num_slabs,
                total_bytes=len(block_ids) * layout.block_bytes,
            )
            async with asyncio.timeout_at(deadline):
                await context.write(kv_transfer_pb2.KVMessage(header=header))
                for spec in plan:
                    ids = block_ids[spec.first_block : spec.first_block + spec.num_blocks]
                    await context.write(
                        await finish_in_thread(
                            self._encode, pages, spec, ids, executor=transfer_executor()
                        )
                    )
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"pull of {request.request_id!r} exceeded max_pull_s={self.max_pull_s}",
            )
        finally:
            await self.end_read(read)

    def _encode(
        self, pages: KVPages, spec: ChunkSpec, block_ids: list[int]
    ) -> kv_transfer_pb2.KVMessage:
        data = tensor_bytes(pages.read_slabs(spec.slab, spec.num_slabs, block_ids))
        message = kv_transfer_pb2.KVMessage()
        # Filled in place: constructing nested messages from kwargs copies the payload twice.
        chunk = message.chunk
        chunk.layer, chunk.kv = spec.layer, spec.kv
        chunk.first_block, chunk.num_blocks = spec.first_block, spec.num_blocks
        chunk.num_slabs = spec.num_slabs
        chunk.data = data
        chunk.crc32 = checksum(data)
        return message


class GrpcKVReceiver(KVReceiver):
    backend = "grpc"

    def __init__(
        self, cache: KVPages, timeout_s: float = 60.0, tls: TlsConfig | None = None
    ) -> None:
        super().__init__(cache)
        self.timeout_s = timeout_s
        self._channels = ChannelPool(TRANSFER_OPTIONS, tls=tls)

    async def close(self) -> None:
        await self._channels.close()

    async def retain_peers(self, kv_addresses: set[str]) -> None:
        await self._channels.retain(kv_addresses)  # retired channels close after a grace

    async def pull(
        self, handle: KVHandle, block_ids: list[int], trace: TraceContext = ()
    ) -> TransferStats:
        self.check_handle(handle, block_ids)
        start = time.perf_counter()
        request = kv_transfer_pb2.PullRequest(
            request_id=handle.request_id,
            receiver_layout=layout_to_proto(self.cache.layout),
            lease_token=handle.lease_token,
            max_slabs_per_chunk=MAX_SLABS_PER_CHUNK,
        )
        channel = self._channels.get(handle.address)
        stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
        call = stub.Pull(request, timeout=self.timeout_s, metadata=trace or None)
        try:
            num_bytes = await self._receive(call, handle, block_ids)
        except grpc.aio.AioRpcError as exc:
            code = _CODES.get(exc.code(), TransferErrorCode.UNAVAILABLE)
            if exc.code() is grpc.StatusCode.UNAVAILABLE:  # gone, or restarting: a new channel
                self._channels.reset(handle.address, channel)
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
        checker: ChunkChecker | None = None
        async for message in call:
            if message.HasField("header"):
                checker = self._check_header(message.header, handle)
                continue
            if checker is None:
                raise KVTransferError(TransferErrorCode.CORRUPTED, "chunk before header")
            # Checked and copied into the cache off the event loop, while gRPC receives the next.
            await finish_in_thread(
                self._write_chunk, checker, message.chunk, block_ids, executor=transfer_executor()
            )
        if checker is None or not checker.complete:
            raise KVTransferError(TransferErrorCode.CORRUPTED, "stream ended before all chunks")
        return checker.num_bytes

    def _write_chunk(
        self, checker: ChunkChecker, chunk: kv_transfer_pb2.KVChunk, block_ids: list[int]
    ) -> None:
        num_slabs = chunk.num_slabs or 1  # 0: a sender from before multi-slab chunks
        spec = ChunkSpec(chunk.layer, chunk.kv, chunk.first_block, chunk.num_blocks, num_slabs)
        data = checker.check(spec, chunk.data, chunk.crc32)
        ids = block_ids[spec.first_block : spec.first_block + spec.num_blocks]
        self.cache.write_slabs(spec.slab, ids, data)

    def _check_header(self, header: kv_transfer_pb2.KVHeader, handle: KVHandle) -> ChunkChecker:
        mismatch = remote_layout_mismatch(self.cache.layout, header.layout)
        if mismatch is not None:
            raise KVTransferError(TransferErrorCode.LAYOUT_MISMATCH, mismatch)
        layout = self.cache.layout
        expected = (handle.num_blocks, handle.num_blocks * layout.block_bytes)
        if (header.num_blocks, header.total_bytes) != expected or header.blocks_per_chunk < 1:
            raise KVTransferError(
                TransferErrorCode.CORRUPTED,
                f"header: {header.num_blocks} blocks, {header.total_bytes} bytes, "
                f"{header.blocks_per_chunk} blocks per chunk; expected (blocks, bytes) {expected}",
            )
        try:
            plan = plan_chunks(
                layout, handle.num_blocks, header.blocks_per_chunk, header.slabs_per_chunk or 1
            )
        except ValueError as exc:
            raise KVTransferError(TransferErrorCode.CORRUPTED, f"header: {exc}") from None
        return ChunkChecker(layout, handle.num_blocks, plan)
