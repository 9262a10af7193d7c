"""Every lease of one KV holder (a prefill worker, a KV store): the table, the reaper, and the
one path that frees.

The rule it enforces is the block-ownership contract in ``kvtransfer/base.py``; the bookkeeping
(pure, clock passed in) is ``LeaseTable``. Callers: the prefill service grants a lease when the
engine pins a request's first token and calls ``end`` for the RPC ``Release``; the KV sender
reads between ``checkout`` and ``checkin`` (``BlockLeases``); the reaper expires leases nobody
came for. The blocks are freed once, through ``_free``: the holder's ``free_pinned`` (a prefill
worker's engine's; a store's pool's), then the sender's ``lease_ended``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from kvtransfer.base import BlockLeases, KVSender, new_lease_token
from kvtransfer.lease_table import LeaseTable
from pdserve.common import metrics

logger = logging.getLogger(__name__)


class LeaseManager(BlockLeases):
    """Exists from the service's construction (``Release`` before the engine loaded answers
    "no such lease"); ``start`` attaches the holder's free and the sender once they exist."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._free_pinned: Callable[[str], Awaitable[None]] | None = None
        self._sender: KVSender | None = None  # told when a lease ends
        self._table = LeaseTable(lease_s)
        self._changed = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self._frees: set[asyncio.Task[None]] = set()  # frees whose caller may have gone

    def __len__(self) -> int:
        return len(self._table)

    def start(self, free_pinned: Callable[[str], Awaitable[None]], sender: KVSender) -> None:
        """``free_pinned(lease id)`` frees what the holder pinned under it (once per lease)."""
        self._free_pinned, self._sender = free_pinned, sender
        self._reaper = asyncio.create_task(self._expire_forever(), name="lease-reaper")

    async def close(self) -> None:
        """A holder's shutdown, in the one safe order: no lease expires while the sender stops,
        no read is in flight once it has, and then every lease still held is freed."""
        await self.stop_reaper()
        if self._sender is not None:
            await self._sender.stop()
        await self.free_all()

    async def stop_reaper(self) -> None:
        """First step of a shutdown: no lease expires while the sender stops."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    async def free_all(self) -> None:
        """Last step of a shutdown, once the sender stopped (no read is in flight): frees every
        lease still held."""
        for request_id in self._table.expire(float("inf")):
            await self._free(request_id)
        await asyncio.gather(*self._frees, return_exceptions=True)  # of cancelled callers

    # ---- the lease's life -------------------------------------------------------------------
    def grant(self, request_id: str, block_ids: list[int]) -> str:
        """Called right after the engine pinned the blocks, before any await, so that no
        cancellation can strand them. Returns the lease's token (it goes into the handle)."""
        token = new_lease_token()
        self._table.grant(request_id, block_ids, self._now(), token)
        self._changed.set()
        return token

    def renew(self, request_id: str, token: str) -> bool:
        return self._table.renew(request_id, self._now(), token)

    async def end(self, request_id: str, token: str | None) -> bool:
        """The lease is over (decode has the blocks, or nobody will pull them). Idempotent:
        False when there was no live lease. ``token``: the lease's, from a peer's ``Release``;
        None when the prefill service itself ends it."""
        leased, free_now = self._table.end(request_id, token)
        if free_now:
            await self._free(request_id)
        return leased

    # ---- BlockLeases: the KV sender's reads -------------------------------------------------
    async def checkout(self, request_id: str, lease_token: str) -> list[int]:
        return self._table.checkout(request_id, lease_token)

    async def checkin(self, request_id: str) -> None:
        if self._table.checkin(request_id):
            await self._free(request_id)
        self._changed.set()

    # ---- the one free path ------------------------------------------------------------------
    async def _free(self, request_id: str) -> None:
        """Frees the blocks, then tells the sender. The table has forgotten the lease by now,
        so this must run to its end even when the caller is cancelled (a ``Release`` whose
        caller went away): else the sender's staged objects or digests would never go."""
        task = asyncio.ensure_future(self._free_now(request_id))
        self._frees.add(task)
        task.add_done_callback(self._frees.discard)
        await asyncio.shield(task)

    async def _free_now(self, request_id: str) -> None:
        assert self._free_pinned is not None, "a lease exists only once the holder does"
        try:
            await self._free_pinned(request_id)
        finally:
            if self._sender is not None:
                self._sender.lease_ended(request_id)
            metrics.LEASED_REQUESTS.set(len(self._table))

    async def _expire_forever(self) -> None:
        while True:
            metrics.LEASED_REQUESTS.set(len(self._table))
            deadline = self._table.next_deadline_s()
            timeout = None if deadline is None else max(deadline - self._now(), 0.0)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            for request_id in self._table.expire(self._now()):
                logger.warning("request_id=%s lease expired; freeing its blocks", request_id)
                metrics.LEASES_EXPIRED.inc()
                try:
                    await self._free(request_id)
                except Exception:  # the reaper must outlive one bad free
                    logger.exception("request_id=%s freeing an expired lease failed", request_id)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()
