"""Ray object store backend: the prefill side puts a request's blocks into the object store as
layer-major buffers (one per range of layers, 64 MiB at most: larger pulls pipeline, the sender
staging range k+1 while the receiver writes range k); the decode side gets each (zero-copy on
the same node, Ray moves it between nodes) and writes it into its blocks, layer by layer, after
checking each layer's xxh3 digest.

The handle's address names the sender's mailbox actor (``kvtransfer.ray_mailbox``), through
which the ``ObjectRef`` reaches the receiver. Both processes must be connected to the same Ray
cluster (inside a Ray actor they are; a plain process connects with ``--ray-address``).

Lifetime (on top of ``kvtransfer.base``): the sender owns the object. It stages it on the
first pull, between ``checkout`` and ``checkin``, and keeps it until ``lease_ended``, so a
second pull of the same request reuses it; the receiver drops its reference when ``pull``
returns. No object outlives its request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import warnings
from typing import Any

import numpy as np
import ray
import torch
import xxhash
from ray.exceptions import RayError

from engine.dtypes import torch_dtype
from engine.kv_layout import KVCacheLayout
from engine.kv_pages import DenseKVPages
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
from kvtransfer.ray_mailbox import ExportReply, LayerRange, PullTicket, spawn_mailbox
from pdserve.common.tracing import TraceContext

logger = logging.getLogger(__name__)

Payload = np.ndarray[Any, np.dtype[np.uint8]]  # [num_layers in range, bytes of one layer]

# A pull's layers travel in ranges of at most this size (at least one layer). Smaller ranges
# overlap more but each costs a few ms of Ray messaging on a busy host: measured best at 64 MiB
# with benchmarks/kv_transfer.py.
RANGE_BYTES = 64 << 20


def layer_digests(payload: Payload) -> tuple[int, ...]:
    # xxh3 runs at ~13 GB/s here against ~3 GB/s for zlib's CRC32: the digest must not cost
    # more than the object store's own copy.
    return tuple(xxhash.xxh3_64_intdigest(layer) for layer in payload)


def layer_ranges(layout: KVCacheLayout, num_blocks: int) -> list[LayerRange]:
    layer_bytes = num_blocks * layout.block_bytes // layout.num_layers
    step = max(1, RANGE_BYTES // max(layer_bytes, 1))
    return [
        LayerRange(first, min(step, layout.num_layers - first))
        for first in range(0, layout.num_layers, step)
    ]


def _require_ray() -> None:
    if not ray.is_initialized():
        raise RuntimeError(
            "the ray KV backend needs a Ray connection: run inside a Ray actor, or pass "
            "--ray-address (auto or HOST:PORT of the cluster's GCS)"
        )


class RayKVSender(KVSender):
    backend = "ray"
    cache: DenseKVPages  # pages in one tensor: the native engine's (kvtransfer.PAGED_BACKENDS)

    def __init__(self, cache: DenseKVPages, leases: BlockLeases) -> None:
        super().__init__(cache, leases)
        self._name = f"pdserve-kv-{uuid.uuid4().hex[:12]}"
        self._namespace = ""
        self._mailbox: Any = None
        self._poller: asyncio.Task[None] | None = None
        self._answers: set[asyncio.Task[None]] = set()
        self._stopping = False
        # request_id -> layer range -> (payload ref, digests): dropped at lease end.
        self._staged: dict[str, dict[LayerRange, tuple[ray.ObjectRef, tuple[int, ...]]]] = {}
        # One range staged at a time, in ask order, through one reused host buffer: ray.put
        # copies it into the object store before the next range is gathered.
        self._stage_lock = asyncio.Lock()
        self._buffer = torch.empty(0, dtype=torch.uint8)

    @property
    def address(self) -> str:
        return f"{self._namespace}/{self._name}"

    @property
    def num_staged(self) -> int:
        return sum(len(ranges) for ranges in self._staged.values())

    @property
    def staged_object_ids(self) -> frozenset[str]:
        """The hex ids of the objects this sender holds (what ``ray memory`` lists)."""
        return frozenset(
            ref.hex() for ranges in self._staged.values() for ref, _ in ranges.values()
        )

    async def start(self) -> None:
        _require_ray()
        self._namespace = ray.get_runtime_context().namespace
        self._mailbox = spawn_mailbox(self._name, self._namespace)
        await self._mailbox.__ray_ready__.remote()
        self._poller = asyncio.create_task(self._poll(), name="ray-kv-mailbox")

    async def stop(self) -> None:
        self._stopping = True
        if self._mailbox is not None:
            ray.kill(self._mailbox)  # ends the long poll and fails pulls still waiting
        if self._poller is not None:
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._answers:
            await asyncio.gather(*self._answers, return_exceptions=True)
        self._staged.clear()

    def lease_ended(self, request_id: str) -> None:
        self._staged.pop(request_id, None)

    async def _poll(self) -> None:
        while not self._stopping:
            try:
                tickets: list[PullTicket] = await self._mailbox.next_tickets.remote()
            except RayError as exc:
                if self._stopping:
                    return
                # Lost (e.g. killed for memory): a new one under the same name keeps every
                # handle already issued valid; pulls waiting on the old one fail UNAVAILABLE.
                logger.error("ray kv mailbox %s lost (%s): starting a new one", self.address, exc)
                if not await self._respawn():
                    return
                continue
            for ticket in tickets:
                task = asyncio.create_task(self._answer(ticket))
                self._answers.add(task)
                task.add_done_callback(self._answers.discard)

    async def _respawn(self, attempts: int = 5) -> bool:
        for attempt in range(attempts):
            try:
                self._mailbox = spawn_mailbox(self._name, self._namespace)
                await self._mailbox.__ray_ready__.remote()
                return True
            except (RayError, ValueError) as exc:  # ValueError: the old name not yet freed
                logger.warning("ray kv mailbox %s not restarted yet: %s", self.address, exc)
                await asyncio.sleep(0.2 * 2**attempt)
        logger.error("ray kv mailbox %s gone for good: pulls from here fail", self.address)
        return False

    async def _answer(self, ticket: PullTicket) -> None:
        """Stages and answers the ticket's ranges in order; stops after an error."""
        for layers in ticket.ranges:
            try:
                reply = await self._export(ticket, layers)
            except Exception as exc:  # the puller must hear something, not time out
                logger.exception("request_id=%s ray kv export failed", ticket.request_id)
                reply = ExportReply(TransferErrorCode.UNAVAILABLE, f"export failed: {exc}")
            try:
                await self._mailbox.answer.remote(ticket.ticket, reply)
            except RayError:
                return  # the mailbox is gone (stopping): the puller sees that too
            if reply.error is not None:
                return

    async def _export(self, ticket: PullTicket, layers: LayerRange) -> ExportReply:
        request_id = ticket.request_id
        num_layers = self.cache.layout.num_layers
        if layers.first < 0 or not 0 < layers.count <= num_layers - layers.first:
            message = f"layers {layers} outside [0, {num_layers})"
            return ExportReply(TransferErrorCode.CORRUPTED, message)
        try:
            read = await self.begin_read(request_id, ticket.lease_token, ticket.trace)
        except KeyError:
            message = f"no lease for request_id {request_id!r}"
            return ExportReply(TransferErrorCode.NOT_FOUND, message)
        block_ids = read.block_ids
        try:
            staged = self._staged.get(request_id, {}).get(layers)
            if staged is None:
                async with self._stage_lock:
                    staged = await finish_in_thread(
                        self._put, block_ids, layers, executor=transfer_executor()
                    )
                self._staged.setdefault(request_id, {})[layers] = staged
        finally:
            await self.end_read(read)  # may end the lease, dropping _staged
        ref, digests = staged
        return ExportReply(
            layout=self.cache.layout, num_blocks=len(block_ids), layer_digests=digests, refs=[ref]
        )

    def _put(
        self, block_ids: list[int], layers: LayerRange
    ) -> tuple[ray.ObjectRef, tuple[int, ...]]:
        payload, digests = self._stage(block_ids, layers)
        return ray.put(payload), digests

    def _stage(self, block_ids: list[int], layers: LayerRange) -> tuple[Payload, tuple[int, ...]]:
        """The range's layers of the blocks as one host buffer ``[layers.count, ...]`` (a view
        of the reused buffer: valid until the next call) and each layer's digest."""
        source = self.cache.words[layers.first : layers.first + layers.count]
        index = torch.tensor(block_ids, dtype=torch.long, device=source.device)
        # [count, 2, n, *slab] (int32 words when quantized)
        shape = (layers.count, 2, len(block_ids), *source.shape[3:])
        num_bytes = math.prod(shape) * source.element_size()
        if self._buffer.numel() < num_bytes:
            self._buffer = torch.empty(num_bytes, dtype=torch.uint8)
        staged = self._buffer[:num_bytes].view(source.dtype).view(shape)
        if source.device.type == "cpu":
            torch.index_select(source, 2, index, out=staged)
        else:
            staged.copy_(source.index_select(2, index))
        payload = self._buffer[:num_bytes].numpy().reshape(layers.count, -1)
        return payload, layer_digests(payload)


class RayKVReceiver(KVReceiver):
    backend = "ray"
    cache: DenseKVPages  # pages in one tensor: the native engine's (kvtransfer.PAGED_BACKENDS)

    def __init__(self, cache: DenseKVPages, timeout_s: float = 60.0) -> None:
        super().__init__(cache)
        _require_ray()
        self.timeout_s = timeout_s
        self._mailboxes: dict[str, Any] = {}

    async def pull(
        self, handle: KVHandle, block_ids: list[int], trace: TraceContext = ()
    ) -> TransferStats:
        self.check_handle(handle, block_ids)
        start = time.perf_counter()
        ranges = layer_ranges(self.cache.layout, len(block_ids))
        replies: Any = None
        ask: Any = None
        num_bytes = 0
        error: KVTransferError | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                mailbox = await self._mailbox(handle.address)
                # One ask for every range; the replies stream back as the sender stages them.
                # The trace only when there is one: a mailbox of an older sender takes three.
                traced = (trace,) if trace else ()
                replies = mailbox.request.options(num_returns="streaming").remote(
                    handle.request_id, tuple(ranges), handle.lease_token, *traced
                )
                for layers in ranges:
                    ask = await replies.__anext__()
                    error, written = await self._receive(ask, layers, handle, block_ids)
                    if error is not None:
                        break
                    num_bytes += written
        except TimeoutError:
            error = KVTransferError(
                TransferErrorCode.UNAVAILABLE,
                f"{handle.address}: no KV within transfer timeout {self.timeout_s} s",
            )
        except RayError as exc:
            self._mailboxes.pop(handle.address, None)
            error = KVTransferError(
                TransferErrorCode.UNAVAILABLE, f"{handle.address}: {type(exc).__name__}: {exc}"
            )
        finally:
            # Unread replies go with the generator, and no frame of a traceback keeps a reply.
            replies = ask = None
        if error is not None:
            raise error
        return TransferStats(num_bytes, time.perf_counter() - start)

    async def _receive(
        self, ask: Any, layers: LayerRange, handle: KVHandle, block_ids: list[int]
    ) -> tuple[KVTransferError | None, int]:
        reply: ExportReply | None = None
        payload: Payload | None = None
        try:
            reply = await ask
            assert reply is not None
            error = self._check(reply, handle, layers)
            if error is not None:
                return error, 0
            payload = await reply.refs[0]
            assert payload is not None
            error = await finish_in_thread(
                self._write,
                payload,
                layers,
                reply.layer_digests,
                block_ids,
                executor=transfer_executor(),
            )
            return error, payload.nbytes
        finally:
            # Dropped before anything propagates: a traceback keeps its frames' locals, and a
            # reference held there would keep the object in the store.
            reply = payload = None

    async def close(self) -> None:
        self._mailboxes.clear()

    async def _mailbox(self, address: str) -> Any:
        mailbox = self._mailboxes.get(address)
        if mailbox is None:
            namespace, _, name = address.rpartition("/")
            try:
                mailbox = await asyncio.to_thread(ray.get_actor, name, namespace=namespace)
            except ValueError:
                raise KVTransferError(
                    TransferErrorCode.UNAVAILABLE, f"no ray KV sender {address!r}"
                ) from None
            self._mailboxes[address] = mailbox
        return mailbox

    def _check(
        self, reply: ExportReply, handle: KVHandle, layers: LayerRange
    ) -> KVTransferError | None:
        if reply.error is not None:
            return KVTransferError(reply.error, f"{handle.address}: {reply.message}")
        assert reply.layout is not None
        mismatch = self.cache.layout.mismatch(reply.layout)
        if mismatch is not None:
            return KVTransferError(TransferErrorCode.LAYOUT_MISMATCH, mismatch)
        if reply.num_blocks != handle.num_blocks or len(reply.layer_digests) != layers.count:
            return KVTransferError(
                TransferErrorCode.CORRUPTED,
                f"sender offers {reply.num_blocks} blocks with {len(reply.layer_digests)} layer "
                f"digests; expected {handle.num_blocks} blocks, {layers.count} layers",
            )
        return None

    def _write(
        self, payload: Payload, layers: LayerRange, digests: tuple[int, ...], block_ids: list[int]
    ) -> KVTransferError | None:
        """Checks and writes the range's layers; returns (never raises) a failure, so that no
        traceback holds the payload."""
        layout = self.cache.layout
        expected = (layers.count, len(block_ids) * layout.block_bytes // layout.num_layers)
        if payload.shape != expected or payload.dtype != np.uint8:
            return KVTransferError(
                TransferErrorCode.CORRUPTED,
                f"payload {payload.shape} {payload.dtype}, expected {expected} uint8",
            )
        shape = (2, len(block_ids), *layout.slab_shape)
        for i, digest in enumerate(digests):
            layer = layers.first + i
            # Checked and written one layer at a time, while the layer is still in cache.
            if xxhash.xxh3_64_intdigest(payload[i]) != digest:
                return KVTransferError(
                    TransferErrorCode.CORRUPTED, f"digest mismatch in layer {layer}"
                )
            with warnings.catch_warnings():
                # A read-only view of the object store; the cache copy is the only write.
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(memoryview(payload[i]), dtype=torch.uint8)
            self.cache.write_layer(
                layer, block_ids, raw.view(torch_dtype(layout.storage_dtype)).view(shape)
            )
        return None
