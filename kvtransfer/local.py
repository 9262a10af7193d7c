"""In-process backend: the receiver copies tensors straight out of the sender's cache.

For tests and single-process setups. Same contract as every backend (see ``kvtransfer.base``):
the copy happens between checkout and checkin, layer by layer.
"""

from __future__ import annotations

import itertools
import time
from typing import ClassVar

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
from pdserve.common.tracing import TraceContext


class LocalKVSender(KVSender):
    backend = "local"
    _registry: ClassVar[dict[str, LocalKVSender]] = {}
    _ids = itertools.count()

    def __init__(self, cache: KVPages, leases: BlockLeases) -> None:
        super().__init__(cache, leases)
        self._address = f"local-{next(self._ids)}"

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        self._registry[self._address] = self

    async def stop(self) -> None:
        self._registry.pop(self._address, None)

    @classmethod
    def lookup(cls, address: str) -> LocalKVSender:
        sender = cls._registry.get(address)
        if sender is None:
            raise KVTransferError(TransferErrorCode.UNAVAILABLE, f"no local sender {address!r}")
        return sender


class LocalKVReceiver(KVReceiver):
    backend = "local"

    async def pull(
        self, handle: KVHandle, block_ids: list[int], trace: TraceContext = ()
    ) -> TransferStats:
        self.check_handle(handle, block_ids)
        sender = LocalKVSender.lookup(handle.address)
        mismatch = sender.cache.layout.mismatch(self.cache.layout)
        if mismatch is not None:
            raise KVTransferError(TransferErrorCode.LAYOUT_MISMATCH, mismatch)
        try:
            read = await sender.begin_read(handle.request_id, handle.lease_token, trace)
        except KeyError:
            raise KVTransferError(
                TransferErrorCode.NOT_FOUND, f"no lease for request {handle.request_id!r}"
            ) from None
        source_ids = read.block_ids
        start = time.perf_counter()
        num_bytes = 0
        try:
            if len(source_ids) != len(block_ids):
                raise KVTransferError(
                    TransferErrorCode.CORRUPTED,
                    f"sender holds {len(source_ids)} blocks, receiver expects {len(block_ids)}",
                )
            for layer in range(self.cache.layout.num_layers):
                data = sender.cache.read_layer(layer, source_ids)
                await finish_in_thread(
                    self.cache.write_layer, layer, block_ids, data, executor=transfer_executor()
                )
                num_bytes += data.numel() * data.element_size()
        finally:
            await sender.end_read(read)
        return TransferStats(num_bytes, time.perf_counter() - start)
