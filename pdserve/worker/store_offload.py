"""A worker's side of the KV store (docs/kv-cache.md, "The store"): the blocks its host tier
evicts are offloaded to the store(s) that place their prefix, instead of only being dropped.

- Placement (``placement``, pure): a prefix's blocks all go to the same ``replicas`` stores,
  chosen by rendezvous hashing on the prompt's first block, so one store holds a prefix's whole
  run (a pull comes from one holder) and a store that joins or leaves moves only its share.
- The engine hands blocks over from its copy thread (``SpillSink.take``), only while a store
  is known (``wanted``: else it does not read them out at all); they wait in a queue bounded
  in bytes (the oldest dropped first, counted) and are sent in batches, one ``Offload`` call
  per store, each bounded by ``timeout_s``. A failed or refused offload only costs a later
  recompute: counted by result, never retried, never the worker's failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import grpc

from engine.kv_layout import KVCacheLayout
from engine.spilled_block import MAX_BLOCKS_PER_OFFLOAD, SpilledBlock, SpillSink
from pdserve.common import metrics
from pdserve.common.channels import ChannelPool
from pdserve.common.convert import layout_to_proto
from pdserve.v1 import kv_store_pb2, kv_store_pb2_grpc

logger = logging.getLogger(__name__)

_BATCH_BYTES = 2 * 2**20  # under gRPC's default 4 MiB message limit (a bigger block: alone)
_REFRESH_S = 1.0  # how often the stores known are looked up again


def placement(head: bytes, stores: Sequence[str], replicas: int) -> list[str]:
    """The ``replicas`` stores (fewer when fewer are known) that hold the prefix whose first
    block is ``head``: highest rendezvous score first."""

    def score(address: str) -> bytes:
        return hashlib.blake2b(address.encode() + b"\x00" + head, digest_size=8).digest()

    return sorted(stores, key=score, reverse=True)[:replicas]


class StoreOffloader(SpillSink):
    def __init__(
        self,
        stores: Callable[[], Awaitable[list[str]]],
        channels: ChannelPool,
        layout: KVCacheLayout,
        replicas: int,
        max_queued_bytes: int = 256 * 2**20,
        timeout_s: float = 5.0,
    ) -> None:
        """``stores()``: the KV stores' addresses known (``PeerDirectory.stores``)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.stores = stores
        self.channels = channels
        self.layout = layout_to_proto(layout)
        self.replicas = replicas
        self.max_queued_bytes = max_queued_bytes
        self.timeout_s = timeout_s
        self._queue: deque[SpilledBlock] = deque()
        self._queued_bytes = 0
        self._stores: list[str] = []  # as last looked up (read from the engine's threads)
        self._ready = asyncio.Event()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Looks the stores up once (bounded by the directory's calls), then keeps them
        current and sends what comes."""
        self._loop = asyncio.get_running_loop()
        try:
            self._stores = await self.stores()
        except Exception:  # looked up again each round
            logger.exception("kv stores: the first lookup failed")
        self._task = asyncio.create_task(self._run(), name="kv-store-offload")

    async def stop(self) -> None:
        """What is still queued is dropped (it only saves a recompute)."""
        self._stopping = True
        self._ready.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        metrics.STORE_OFFLOADS.labels("dropped").inc(len(self._queue))
        self._queue.clear()
        self._queued_bytes = 0

    # ---- SpillSink: called from the engine's threads ----------------------------------------
    def wanted(self) -> bool:
        return bool(self._stores) and not self._stopping

    def take(self, blocks: list[SpilledBlock]) -> None:
        loop = self._loop
        if loop is not None and not self._stopping:
            with contextlib.suppress(RuntimeError):  # the loop closed: the worker is stopping
                loop.call_soon_threadsafe(self._enqueue, blocks)

    # ---- on the event loop ------------------------------------------------------------------
    def _enqueue(self, blocks: list[SpilledBlock]) -> None:
        self._queue.extend(blocks)
        self._queued_bytes += sum(len(b.data) for b in blocks)
        dropped = 0
        while self._queued_bytes > self.max_queued_bytes:
            self._queued_bytes -= len(self._queue.popleft().data)
            dropped += 1
        if dropped:
            metrics.STORE_OFFLOADS.labels("dropped").inc(dropped)
        self._ready.set()

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_REFRESH_S):
                    await self._ready.wait()
            self._ready.clear()
            try:
                self._stores = await self.stores()  # a store that joined or left
                while self._queue and not self._stopping:
                    await self._send(self._batch())
            except Exception:  # the loop must outlive one bad round
                logger.exception("offloading KV blocks to the store failed")

    def _batch(self) -> list[SpilledBlock]:
        batch = [self._queue.popleft()]
        size = len(batch[0].data)
        while self._queue and len(batch) < MAX_BLOCKS_PER_OFFLOAD:
            if size + len(self._queue[0].data) > _BATCH_BYTES:
                break
            batch.append(self._queue.popleft())
            size += len(batch[-1].data)
        self._queued_bytes -= size
        return batch

    async def _send(self, batch: list[SpilledBlock]) -> None:
        stores = self._stores
        if not stores:
            metrics.STORE_OFFLOADS.labels("no_store").inc(len(batch))
            return
        by_store: dict[str, list[SpilledBlock]] = {}
        for block in batch:
            for address in placement(block.head, stores, self.replicas):
                by_store.setdefault(address, []).append(block)
        await asyncio.gather(*(self._offload(a, blocks) for a, blocks in by_store.items()))

    async def _offload(self, address: str, blocks: list[SpilledBlock]) -> None:
        request = kv_store_pb2.OffloadRequest(
            layout=self.layout,
            blocks=[
                kv_store_pb2.OffloadedBlock(
                    block_hash=b.block_hash,
                    parent_hash=b.parent,
                    data=b.data,
                    crc32=zlib.crc32(b.data),
                )
                for b in blocks
            ],
        )
        stub = kv_store_pb2_grpc.KVStoreStub(self.channels.get(address))
        try:
            reply = await stub.Offload(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            metrics.STORE_OFFLOADS.labels("failed").inc(len(blocks))
            logger.warning(
                "kv store %s: offload of %d blocks failed (%s: %s)",
                address,
                len(blocks),
                exc.code().name,
                exc.details(),
            )
            return
        metrics.STORE_OFFLOADS.labels("stored").inc(reply.num_stored)
        metrics.STORE_OFFLOADS.labels("held").inc(reply.num_held)
        metrics.STORE_OFFLOADS.labels("refused").inc(reply.num_refused)
