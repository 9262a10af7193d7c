"""The prefill workers (and KV stores) a worker pulls KV from: never an address a caller names.

A ``Decode`` request names its prefill worker (``prefill_address``, for ``Release``) and the KV
sender (``handle.address``); a peer pull's ``PrefixSource`` names the holder. Each must be a
known prefill worker's: one in the registry (with Redis) or in ``--prefill-peers``, and that
worker's own KV sender. Otherwise the request is refused (PERMISSION_DENIED; a peer pull falls
back to computing) before anything is reserved or dialled, so nobody can make a worker dial an
address of their choosing, or fill its prefix cache with KV from a sender of theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc
from redis.exceptions import RedisError

from pdserve.cluster.last_known import LastKnownWorkers
from pdserve.cluster.registry import Registry
from pdserve.common.channels import ChannelPool
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

_MIN_REFRESH_S = 0.1  # the shortest gap between two refreshes
# Kept current in the background too, so that the peers are known before Redis (if ever) goes
# away: every second, and every _MIN_REFRESH_S while none is known yet (a fresh cluster).
_REFRESH_S = 1.0
_STATS_TIMEOUT_S = 2.0


def peer_refusal(peers: Mapping[str, str], prefill_address: str, kv_address: str) -> str | None:
    """Why a request naming this prefill worker and KV sender is refused, or None.
    ``peers``: control address -> its KV sender's address."""
    known = peers.get(prefill_address)
    if known is None:
        return f"prefill_address {prefill_address!r} is not a known prefill worker"
    if known != kv_address:
        return (
            f"handle.address {kv_address!r} is not the KV sender of prefill worker "
            f"{prefill_address!r}"
        )
    return None


class PeerDirectory:
    def __init__(
        self,
        static: tuple[str, ...],
        registry: Registry | None,
        channels: ChannelPool,
        last_known: LastKnownWorkers | None = None,
        on_change: Callable[[Mapping[str, str]], Awaitable[None]] | None = None,
        stores: tuple[str, ...] | None = None,
    ) -> None:
        """``on_change(peers)`` is awaited after a refresh that changed the peers (control
        address -> KV sender): the owner drops what it keeps for departed ones. ``stores``:
        KV stores count as holders too (a prefill worker's pulls and offloads; None: they do
        not, as for a decode worker), those of the registry and these addresses."""
        self.static = static
        self.with_stores = stores is not None
        self.static_stores = stores or ()
        self._stores: set[str] = set()  # the holders that are KV stores
        self.on_change = on_change
        self.registry = registry
        self.channels = channels
        self.last_known = last_known or LastKnownWorkers(None)
        # Peers from before a restart: probed like static ones until the registry answers.
        self._remembered = {
            r.address for r in self.last_known.load() if r.role is Role.PREFILL and r.kv_address
        }
        self._peers: dict[str, str] = {}
        self._refreshed_s = -_MIN_REFRESH_S
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever(), name="prefill-peers")

    async def stop(self) -> None:
        self._stopping.set()  # by flag, not cancel (a cancel can be lost inside redis-py)
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _refresh_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.refresh()
            except Exception:  # the loop must outlive one bad round
                logger.exception("prefill peers refresh failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_REFRESH_S if self._peers else _MIN_REFRESH_S):
                    await self._stopping.wait()

    def known(self) -> dict[str, str]:
        """The peers known now: control address -> KV sender."""
        return dict(self._peers)

    @property
    def _roles(self) -> tuple[Role, ...]:
        return (Role.PREFILL, Role.KVSTORE) if self.with_stores else (Role.PREFILL,)

    async def stores(self) -> list[str]:
        """The KV stores known (answering, or in the registry), by control address; looked up
        once more (rate-bounded) while none is known."""
        if not self._stores and self.with_stores:
            await self.refresh(since_s=asyncio.get_running_loop().time())
        return sorted(self._stores)

    async def kv_sender(self, prefill_address: str) -> str | None:
        """The KV sender of a known prefill worker, or None (looked up once more, as in
        ``refusal``): checked before the worker is dialled."""
        known = self._peers.get(prefill_address)
        if known is None:
            await self.refresh(since_s=asyncio.get_running_loop().time())
            known = self._peers.get(prefill_address)
        return known

    async def refusal(self, prefill_address: str, kv_address: str) -> str | None:
        """Why the request is refused, or None. An unknown peer is looked up once more, in
        a refresh begun after the request arrived (a worker that registered just now)."""
        why = peer_refusal(self._peers, prefill_address, kv_address)
        if why is not None:
            await self.refresh(since_s=asyncio.get_running_loop().time())
            why = peer_refusal(self._peers, prefill_address, kv_address)
        return why

    async def refresh(self, since_s: float | None = None) -> None:
        """Re-reads the registry and asks static peers for their KV address (concurrently),
        at most every ``_MIN_REFRESH_S``; a Redis or peer failure keeps what was known.
        ``since_s``: the caller needs a refresh begun at or after that time; callers waiting
        together share one."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            if since_s is not None:
                if self._refreshed_s >= since_s:
                    return  # one began after the caller asked
                # The rate bound: bogus requests must not turn into a Redis or RPC storm.
                await asyncio.sleep(max(0.0, self._refreshed_s + _MIN_REFRESH_S - loop.time()))
            elif loop.time() - self._refreshed_s < _MIN_REFRESH_S:
                return
            self._refreshed_s = loop.time()
            peers: dict[str, str] = {}
            stores = set(self._stores)
            if self.registry is not None:
                try:
                    records = [
                        r
                        for r in await self.registry.workers()
                        if r.role in self._roles and r.kv_address
                    ]
                except (RedisError, OSError) as exc:
                    logger.warning("prefill peers: registry unavailable (%s)", exc)
                    peers.update(self._peers)
                else:
                    peers.update((r.address, r.kv_address) for r in records)
                    stores = {r.address for r in records if r.role is Role.KVSTORE}
                    self.last_known.save([r for r in records if r.role is Role.PREFILL])
                    self._remembered.clear()
            # Static peers, remembered ones, and known ones whose record is gone (Redis
            # restarted empty): kept while they answer, with the KV sender they name.
            gone = (a for a in self._peers if a not in peers)
            probed = sorted({*self.static, *self.static_stores, *self._remembered, *gone})
            kv_addresses = await asyncio.gather(*(self._kv_address(a) for a in probed))
            for address, kv_address in zip(probed, kv_addresses, strict=True):
                if kv_address:
                    peers[address] = kv_address
            stores.update(self.static_stores)
            self._stores = stores & set(peers)
            changed, self._peers = peers != self._peers, peers
            if changed and self.on_change is not None:
                await self.on_change(peers)

    async def _kv_address(self, address: str) -> str:
        stub = prefill_pb2_grpc.PrefillWorkerStub(self.channels.get(address))
        try:
            stats = await stub.GetStats(common_pb2.GetStatsRequest(), timeout=_STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.warning("peer %s: %s", address, exc.code().name)
            return ""
        return str(stats.kv_address)
