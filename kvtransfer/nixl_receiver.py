"""The NIXL backend's decode side: one NIXL agent over the whole KV cache (registered once),
and per prefill peer its agent, learned over the peer's control plane (``NixlControl``).

A pull: ``Checkout`` (the lease's blocks held, where they are, their digest); one READ of
those blocks straight into the caller's reserved blocks (no gather, no staging buffer, no
scatter), run and polled in a thread; the digest of what was written checked against the
sender's (``verify``); ``Checkin``. The peer is cached *with its incarnation*: a prefill worker
restarted at the same address answers ``Checkout`` with a new one, and is handshaken again
before anything is read, so no READ ever targets a dead agent's memory. Any failed READ drops
the cached peer too.

Cancellation: the READ's thread is told to stop and waited for, so when ``pull`` returns or
raises nothing writes into the blocks any more (the contract in ``kvtransfer/base.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from engine.kv_pages import SKIP_BLOCK, KVPages
from engine.threads import finish_in_thread, transfer_executor
from kvtransfer.base import (
    KVHandle,
    KVReceiver,
    KVTransferError,
    TransferErrorCode,
    TransferStats,
)
from kvtransfer.block_digest import block_digest
from kvtransfer.nixl_agent import acquire_agent, region_of, release_agent
from kvtransfer.nixl_plan import Region, Row, plan_read
from pdserve.common.channels import ChannelPool
from pdserve.common.convert import layout_to_proto, remote_layout_mismatch
from pdserve.common.tls import TlsConfig
from pdserve.common.tracing import TraceContext
from pdserve.v1 import nixl_pb2, nixl_pb2_grpc

logger = logging.getLogger(__name__)

_CODES = {
    grpc.StatusCode.FAILED_PRECONDITION: TransferErrorCode.LAYOUT_MISMATCH,
    grpc.StatusCode.NOT_FOUND: TransferErrorCode.NOT_FOUND,
}
# The READ must end well inside the sender's hold of the blocks.
_HOLD_SHARE = 0.8
_CHECKIN_TIMEOUT_S = 5.0
T = TypeVar("T")


@dataclass(frozen=True)
class _Peer:
    agent_name: str
    incarnation: str
    region: Region
    mem_type: str


class NixlKVReceiver(KVReceiver):
    backend = "nixl"

    def __init__(
        self,
        cache: KVPages,
        timeout_s: float = 60.0,
        tls: TlsConfig | None = None,
        verify: bool = True,
        ucx_tls: str | None = None,
    ) -> None:
        super().__init__(cache)
        self.timeout_s = timeout_s
        self.verify = verify
        self.agent = acquire_agent("decode", cache, ucx_tls)
        self._region = region_of(cache)  # where this receiver's pages (a view's) lie
        self._channels = ChannelPool(tls=tls)
        self._peers: dict[str, _Peer] = {}
        self._handshakes: dict[str, asyncio.Lock] = {}
        self._checkins: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        await asyncio.gather(*self._checkins, return_exceptions=True)
        for peer in list(self._peers.values()):
            await self._forget(peer)
        await self._channels.close()
        await asyncio.to_thread(release_agent, self.agent)

    async def retain_peers(self, kv_addresses: set[str]) -> None:
        for address, peer in list(self._peers.items()):
            if address not in kv_addresses:
                await self._forget(peer)  # its remote agent goes once no READ uses it
        for address, lock in list(self._handshakes.items()):
            if address not in kv_addresses and not lock.locked():
                del self._handshakes[address]
        await self._channels.retain(kv_addresses)

    def _stub(self, address: str) -> nixl_pb2_grpc.NixlControlStub:
        return nixl_pb2_grpc.NixlControlStub(self._channels.get(address))

    async def pull(
        self, handle: KVHandle, block_ids: list[int], trace: TraceContext = ()
    ) -> TransferStats:
        self.check_handle(handle, block_ids)
        start = time.perf_counter()
        deadline_s = time.monotonic() + self.timeout_s
        try:
            async with asyncio.timeout(self.timeout_s):
                peer = await self._peer(handle.address, deadline_s)
                # A block this engine holds already (SKIP_BLOCK) is neither read nor digested.
                skip = [i for i, b in enumerate(block_ids) if b == SKIP_BLOCK]
                request = nixl_pb2.NixlCheckoutRequest(
                    request_id=handle.request_id,
                    lease_token=handle.lease_token,
                    want_digest=self.verify,
                    receiver_layout=layout_to_proto(self.cache.layout),
                    skip=skip,
                )
                checkout = await self._call(
                    handle.address, _checkout, request, deadline_s, metadata=trace
                )
        except grpc.aio.AioRpcError as exc:
            code = _CODES.get(exc.code(), TransferErrorCode.UNAVAILABLE)
            if code is TransferErrorCode.UNAVAILABLE:  # gone or restarting: handshake anew
                await self._forget_address(handle.address)
            raise KVTransferError(code, f"{handle.address}: {exc.details()}") from None
        except TimeoutError:
            await self._forget_address(handle.address)
            raise KVTransferError(
                TransferErrorCode.UNAVAILABLE, f"{handle.address}: no checkout in time"
            ) from None
        # The sender's hold began when it answered: the READ must end well inside it.
        hold_deadline_s = time.monotonic() + _HOLD_SHARE * checkout.hold_s
        try:
            if checkout.incarnation != peer.incarnation:  # restarted at the same address
                peer = await self._rehandshake(handle.address, peer, deadline_s)
                if checkout.incarnation != peer.incarnation:
                    raise KVTransferError(
                        TransferErrorCode.UNAVAILABLE, f"{handle.address} restarted again"
                    )
            kept = [i for i, b in enumerate(block_ids) if b != SKIP_BLOCK]
            sources = list(checkout.block_ids)
            try:
                if len(sources) != len(block_ids):
                    raise ValueError(f"of {len(sources)} blocks for {len(block_ids)}")
                local_rows, remote_rows = plan_read(
                    self.cache.layout,
                    self._region,
                    peer.region,
                    [sources[i] for i in kept],
                    [block_ids[i] for i in kept],
                )
            except ValueError as exc:  # block ids outside the sender's own cache, or too few
                raise KVTransferError(
                    TransferErrorCode.CORRUPTED, f"{handle.address}: checkout {exc}"
                ) from None
            await self._read(peer, local_rows, remote_rows, min(deadline_s, hold_deadline_s))
            if self.verify:
                written = [block_ids[i] for i in kept]
                digest = await finish_in_thread(
                    block_digest, self.cache, written, executor=transfer_executor()
                )
                if digest != checkout.digest:
                    raise KVTransferError(
                        TransferErrorCode.CORRUPTED,
                        f"{handle.address}: the blocks read differ from the sender's digest",
                    )
        finally:
            self._checkin_later(handle, checkout.checkout_id)
        num_bytes = len(block_ids) * self.cache.layout.block_bytes
        return TransferStats(num_bytes, time.perf_counter() - start)

    async def _read(
        self, peer: _Peer, local_rows: list[Row], remote_rows: list[Row], deadline_s: float
    ) -> None:
        stop = threading.Event()
        agent = self.agent
        work = (peer.agent_name, peer.mem_type, local_rows, remote_rows, stop, deadline_s)
        read = asyncio.ensure_future(
            finish_in_thread(agent.read, *work, executor=transfer_executor())
        )
        try:
            await asyncio.shield(read)
        except asyncio.CancelledError:
            stop.set()  # and wait (ReadStopped, or done): the caller may free the blocks next
            await asyncio.wait([read])
            raise
        except KVTransferError:
            await self._forget(peer)
            raise

    async def _rehandshake(self, address: str, stale: _Peer, deadline_s: float) -> _Peer:
        try:
            async with asyncio.timeout(max(0.0, deadline_s - time.monotonic())):
                return await self._peer(address, deadline_s, stale=stale)
        except grpc.aio.AioRpcError as exc:
            raise KVTransferError(
                TransferErrorCode.UNAVAILABLE, f"{address}: handshake: {exc.details()}"
            ) from None
        except TimeoutError:
            raise KVTransferError(
                TransferErrorCode.UNAVAILABLE, f"{address}: no handshake in time"
            ) from None

    async def _peer(self, address: str, deadline_s: float, stale: _Peer | None = None) -> _Peer:
        """The cached peer, or a handshake (one at a time per address); ``stale``: the cached
        one is out of date (restarted): forget it first."""
        lock = self._handshakes.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(address)
            if peer is not None and peer is not stale:
                return peer
            if peer is not None:
                await self._forget(peer)
            request = nixl_pb2.NixlHandshakeRequest(
                receiver_layout=layout_to_proto(self.cache.layout)
            )
            response = await self._call(address, _handshake, request, deadline_s)
            mismatch = remote_layout_mismatch(self.cache.layout, response.layout)
            if mismatch is not None:
                raise KVTransferError(TransferErrorCode.LAYOUT_MISMATCH, mismatch)
            try:
                name = await finish_in_thread(
                    self.agent.add_remote, response.agent_metadata, executor=transfer_executor()
                )
            except Exception as exc:  # metadata NIXL cannot use (another NIXL, corrupted)
                raise KVTransferError(
                    TransferErrorCode.UNAVAILABLE, f"{address}: NIXL add_remote_agent: {exc}"
                ) from None
            if not response.slab_bases:  # a sender from before slabs had bases of their own
                raise KVTransferError(
                    TransferErrorCode.LAYOUT_MISMATCH,
                    f"{address}: its NIXL control plane sends no slab_bases (an older pdserve): "
                    "run one release on both sides",
                )
            region = Region(
                tuple(response.slab_bases),
                tuple(response.slab_strides),
                response.num_blocks,
                response.device_id,
            )
            peer = _Peer(name, response.incarnation, region, response.mem_type)
            self._peers[address] = peer
            logger.info("nixl peer %s: agent %s", address, name)
            return peer

    async def _forget_address(self, address: str) -> None:
        peer = self._peers.get(address)
        if peer is not None:
            await self._forget(peer)

    async def _forget(self, peer: _Peer) -> None:
        """Drops a cached peer; NIXL's remote agent goes once no READ uses it any more
        (``NixlAgent.remove_remote``), in a thread: a disconnect can block."""
        for address, known in list(self._peers.items()):
            if known is peer:
                del self._peers[address]
                await asyncio.to_thread(self.agent.remove_remote, peer.agent_name)

    async def _call(
        self,
        address: str,
        method: Callable[[nixl_pb2_grpc.NixlControlStub], Callable[..., Awaitable[T]]],
        request: object,
        deadline_s: float,
        metadata: TraceContext = (),
    ) -> T:
        """A control RPC, failing fast; when the channel was down, once more on a fresh channel
        (``ChannelPool.reset``), failing fast too. A channel that saw its peer die fails at
        once even when a successor at the same address is up already: the fresh one reaches a
        restarted peer at once, and a dead one is known at once (connection refused), not at
        the deadline. Only once: a checkout is held until its checkin or ``hold_s``."""
        for last in (False, True):
            channel = self._channels.get(address)
            rpc = method(nixl_pb2_grpc.NixlControlStub(channel))
            try:
                timeout = max(0.01, deadline_s - time.monotonic())
                return await rpc(request, timeout=timeout, metadata=metadata or None)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._channels.reset(address, channel)
                if last:
                    raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _checkin_later(self, handle: KVHandle, checkout_id: str) -> None:
        """Ends the hold without making the pull (or its cancellation) wait for it; a lost
        Checkin leaves the hold to ``max_pull_s``."""

        async def checkin() -> None:
            request = nixl_pb2.NixlCheckinRequest(
                request_id=handle.request_id, checkout_id=checkout_id
            )
            try:
                await self._stub(handle.address).Checkin(request, timeout=_CHECKIN_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                logger.info("request_id=%s checkin: %s", handle.request_id, exc.code().name)

        task = asyncio.get_running_loop().create_task(checkin())
        self._checkins.add(task)
        task.add_done_callback(self._checkins.discard)


def _checkout(stub: nixl_pb2_grpc.NixlControlStub) -> Callable[..., Awaitable[Any]]:
    return stub.Checkout


def _handshake(stub: nixl_pb2_grpc.NixlControlStub) -> Callable[..., Awaitable[Any]]:
    return stub.Handshake
