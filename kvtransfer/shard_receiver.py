"""A receiver that takes KV from a prefill engine of any tensor parallelism its pages map to
(``engine/kv_shards.py``): a pull is the reads ``shard_reads`` names, each from the prefill rank
that holds its shard, into the heads of these pages that hold it (``KVPages.shard``), by a
backend receiver over that view (one per view, made on first use).

Used where a tensor-parallel engine's pages are (a vLLM engine's front-end at tensor_parallel_size
1, every rank's process above: ``vllm_engine/rank_runtime.py``). A tensor-parallel engine's
handle names its ranks' senders, comma-separated in rank order (``ADDRESS_SEPARATOR``).

The receiver contract (``kvtransfer/base.py``) holds for the whole pull: it returns or raises
only once every read stopped writing; the first failure, or a cancel, cancels the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Sequence
from typing import Any

from engine.kv_layout import KVCacheLayout
from engine.kv_pages import KVPages
from engine.kv_shards import shard_mismatch, shard_reads
from kvtransfer import ReceiverOptions, make_receiver
from kvtransfer.base import (
    KVHandle,
    KVReceiver,
    KVTransferError,
    TransferErrorCode,
    TransferStats,
)
from pdserve.common.tracing import TraceContext

ADDRESS_SEPARATOR = ","


def source_addresses(handle: KVHandle) -> list[str]:
    """The handle's senders in rank order: one per rank of its engine (``layout.tp_size``)."""
    addresses = handle.address.split(ADDRESS_SEPARATOR)
    if len(addresses) != handle.layout.tp_size or not all(addresses):
        raise KVTransferError(
            TransferErrorCode.CORRUPTED,
            f"handle address {handle.address!r} names {len(addresses)} senders for tp_size "
            f"{handle.layout.tp_size}",
        )
    return addresses


class MapsShards(KVReceiver):
    """A receiver that takes a handle of any tensor parallelism its layout maps to (this one
    and the vLLM engine's per-rank facade, ``vllm_engine/rank_transfer.py``)."""

    def layout_refusal(self, layout: KVCacheLayout) -> str | None:
        return shard_mismatch(layout, self.layout)

    def check_shard_handle(self, handle: KVHandle, block_ids: list[int]) -> list[str]:
        """``check_handle``, then the handle's senders in rank order (refused by name)."""
        self.check_handle(handle, block_ids)
        return source_addresses(handle)


class ShardReceiver(MapsShards):
    def __init__(self, backend: str, pages: KVPages, options: ReceiverOptions) -> None:
        super().__init__(pages)
        self.backend = backend
        self._options = options
        self._receivers: dict[KVCacheLayout, KVReceiver] = {}
        self._making = asyncio.Lock()

    async def pull(
        self, handle: KVHandle, block_ids: list[int], trace: TraceContext = ()
    ) -> TransferStats:
        addresses = self.check_shard_handle(handle, block_ids)
        reads = shard_reads(handle.layout, self.layout)
        receivers = [await self._receiver(read.layout) for read in reads]
        return await pull_all(
            [
                receiver.pull(
                    dataclasses.replace(
                        handle, address=addresses[read.source_rank], layout=read.layout
                    ),
                    block_ids,
                    trace,
                )
                for receiver, read in zip(receivers, reads, strict=True)
            ]
        )

    async def _receiver(self, layout: KVCacheLayout) -> KVReceiver:
        """The backend's receiver over the view holding ``layout``: made once, in a thread (a
        NIXL agent's start blocks), one at a time."""
        async with self._making:
            receiver = self._receivers.get(layout)
            if receiver is None:
                pages = self.cache.shard(layout)
                receiver = await asyncio.to_thread(
                    make_receiver, self.backend, pages, self._options
                )
                self._receivers[layout] = receiver
            return receiver

    async def retain_peers(self, kv_addresses: set[str]) -> None:
        ranks = {a for joined in kv_addresses for a in joined.split(ADDRESS_SEPARATOR)}
        for receiver in self._receivers.values():
            await receiver.retain_peers(ranks)

    async def close(self) -> None:
        for receiver in self._receivers.values():
            await receiver.close()


async def pull_all(pulls: list[Coroutine[Any, Any, TransferStats]]) -> TransferStats:
    """Runs the reads of one pull together; returns or raises once none is writing (the first
    failure, or a cancel of the caller, cancels the others and waits for them)."""
    if len(pulls) == 1:
        return await pulls[0]
    tasks = [asyncio.ensure_future(p) for p in pulls]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await settle(tasks)
        raise
    return TransferStats(sum(s.num_bytes for s in done), max(s.duration_s for s in done))


async def settle(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Returns once every task is done (their outcomes taken: none is left unretrieved), even
    when the caller is cancelled meanwhile: a pull's contract is that nothing writes once it
    returned. A cancel that came while waiting is raised then."""
    cancelled = False
    while not all(task.done() for task in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            cancelled = True  # not before the reads stopped writing
    for task in tasks:
        if not task.cancelled():
            task.exception()
    if cancelled:
        raise asyncio.CancelledError
