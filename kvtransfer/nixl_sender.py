"""The NIXL backend's prefill side: one NIXL agent over the whole KV cache (registered once at
start), and the control plane decode workers use before their one-sided READs
(``pdserve.v1.NixlControl`` on the KV port, mutual TLS when configured).

A READ bypasses the sender, so leases are held explicitly: ``Checkout`` checks the request's
blocks out of the lease manager (``BlockLeases``: nothing frees them meanwhile) and returns
where they are; they stay checked out until the receiver's ``Checkin`` or ``max_pull_s``,
whichever comes first. The receiver reads within ``hold_s`` (the response says how long).
With ``want_digest`` the response carries the blocks' digest (``kvtransfer/block_digest.py``),
which the receiver checks against what it wrote. With ``verify`` the digest is recorded as the
handle is issued (in a thread, while the handle travels to the decode worker), so a checkout
finds it ready; without, it is computed only when a checkout asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

import grpc

from engine.kv_pages import KVPages
from engine.threads import finish_in_thread, transfer_executor
from kvtransfer.base import BlockLeases, BlockRead, KVHandle, KVSender
from kvtransfer.block_digest import block_digest
from kvtransfer.nixl_agent import NixlAgent, region_of
from pdserve.common import peer_token, tracing
from pdserve.common.channels import SERVER_OPTIONS
from pdserve.common.convert import layout_from_proto, layout_to_proto
from pdserve.common.tls import TlsConfig, add_port
from pdserve.v1 import common_pb2, nixl_pb2, nixl_pb2_grpc

logger = logging.getLogger(__name__)
_STOP_GRACE_S = 5.0  # how long stop() lets READs in flight finish before freeing their blocks


@dataclass
class _Checkout:
    read: BlockRead
    timer: asyncio.TimerHandle

    @property
    def request_id(self) -> str:
        return self.read.request_id


class NixlKVSender(KVSender, nixl_pb2_grpc.NixlControlServicer):
    backend = "nixl"

    def __init__(
        self,
        cache: KVPages,
        leases: BlockLeases,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        tls: TlsConfig | None = None,
        max_pull_s: float = 60.0,
        verify: bool = True,
        ucx_tls: str | None = None,
    ) -> None:
        super().__init__(cache, leases)
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.tls = tls
        self.max_pull_s = max_pull_s
        self.verify = verify
        self.ucx_tls = ucx_tls
        self._agent: NixlAgent | None = None
        self._server: grpc.aio.Server | None = None
        self._address = ""
        self._checkouts: dict[str, _Checkout] = {}
        self._ending: set[asyncio.Task[None]] = set()
        self._digests: dict[str, asyncio.Task[bytes]] = {}  # request_id -> its blocks' digest
        self._no_checkouts = asyncio.Event()
        self._no_checkouts.set()

    @property
    def address(self) -> str:
        return self._address

    @property
    def agent(self) -> NixlAgent:
        if self._agent is None:
            raise RuntimeError("the NIXL sender is not started")
        return self._agent

    async def start(self) -> None:
        self._agent = await asyncio.to_thread(NixlAgent, "prefill", self.cache, self.ucx_tls)
        interceptors = peer_token.server_interceptors()  # the cluster's token, if any
        self._server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        nixl_pb2_grpc.add_NixlControlServicer_to_server(self, self._server)
        port = add_port(self._server, f"{self.host}:{self.port}", self.tls)
        self._address = f"{self.advertise_host}:{port}"
        await self._server.start()
        logger.info(
            "nixl sender %s: cache of %d blocks registered", self.agent.name, self.cache.num_blocks
        )

    async def stop(self) -> None:
        # Holds end with their checkins (a READ may still run): a bounded wait, then forced.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_STOP_GRACE_S):
                await self._no_checkouts.wait()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await asyncio.gather(*self._digests.values(), return_exceptions=True)
        self._digests.clear()
        for checkout_id in list(self._checkouts):
            await self._end(checkout_id)
        if self._agent is not None:
            await asyncio.to_thread(self._agent.close)

    def handle(
        self,
        request_id: str,
        num_blocks: int,
        lease_s: float,
        lease_token: str,
        digest: bytes,
    ) -> KVHandle:
        if self.verify:
            self._record_digest(request_id, lease_token)
        return super().handle(request_id, num_blocks, lease_s, lease_token, digest)

    def recorded_digests(self) -> list[asyncio.Task[bytes]]:
        return list(self._digests.values())

    def lease_ended(self, request_id: str) -> None:
        self._digests.pop(request_id, None)  # done: the digest held a checkout until then

    def _record_digest(self, request_id: str, lease_token: str) -> None:
        async def held() -> bytes:
            try:
                block_ids = await self.leases.checkout(request_id, lease_token)
            except KeyError:  # the lease is already over: a checkout computes its own
                return b""
            try:
                return await finish_in_thread(
                    block_digest, self.cache, block_ids, executor=transfer_executor()
                )
            finally:
                await self.leases.checkin(request_id)

        self._digests[request_id] = asyncio.get_running_loop().create_task(held())

    async def _digest(
        self, request: nixl_pb2.NixlCheckoutRequest, pages: KVPages, block_ids: list[int]
    ) -> bytes:
        """The digest of the blocks the receiver reads: the one recorded with the handle (all
        of them, whole pages), or computed now; either way in a thread, in place: the
        checked-out blocks cannot change."""
        skip = set(request.skip)
        recorded = self._digests.get(request.request_id)
        whole = pages is self.cache and not skip and recorded is not None
        if whole and recorded is not None and (digest := await asyncio.shield(recorded)):
            return digest
        read = [b for i, b in enumerate(block_ids) if i not in skip]
        return await finish_in_thread(block_digest, pages, read, executor=transfer_executor())

    async def _shard(
        self, layout: common_pb2.KVCacheLayout, context: grpc.aio.ServicerContext
    ) -> KVPages:
        """The pages holding the shard a receiver reads (engine/kv_shards.py), or an abort."""
        try:
            return self.cache.shard(layout_from_proto(layout))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        raise AssertionError("unreachable: abort raises")

    async def Handshake(
        self, request: nixl_pb2.NixlHandshakeRequest, context: grpc.aio.ServicerContext
    ) -> nixl_pb2.NixlHandshakeResponse:
        pages = await self._shard(request.receiver_layout, context)
        agent, region = self.agent, region_of(pages)
        return nixl_pb2.NixlHandshakeResponse(
            agent_name=agent.name,
            agent_metadata=agent.metadata,
            incarnation=agent.incarnation,
            layout=layout_to_proto(pages.layout),
            num_blocks=region.num_blocks,
            device_id=region.device_id,
            mem_type=agent.mem_type,
            slab_bases=region.bases,
            slab_strides=region.strides,
        )

    async def Checkout(
        self, request: nixl_pb2.NixlCheckoutRequest, context: grpc.aio.ServicerContext
    ) -> nixl_pb2.NixlCheckoutResponse:
        return await self.checkout(request, context)

    async def checkout(
        self, request: nixl_pb2.NixlCheckoutRequest, context: grpc.aio.ServicerContext
    ) -> nixl_pb2.NixlCheckoutResponse:
        """The RPC's body, looked up per call (fault tests wrap it)."""
        try:
            trace = tracing.headers(context.invocation_metadata())
            read = await self.begin_read(request.request_id, request.lease_token, trace)
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no lease for request_id {request.request_id!r}"
            )
        block_ids = read.block_ids
        held = False
        try:
            digest = b""
            if request.want_digest:
                pages = self.cache
                if request.HasField("receiver_layout"):
                    pages = await self._shard(request.receiver_layout, context)
                digest = await self._digest(request, pages, block_ids)
            checkout_id = uuid.uuid4().hex
            timer = asyncio.get_running_loop().call_later(
                self.max_pull_s, self._expire, checkout_id
            )
            self._checkouts[checkout_id] = _Checkout(read, timer)
            self._no_checkouts.clear()
            held = True
            return nixl_pb2.NixlCheckoutResponse(
                block_ids=block_ids,
                digest=digest,
                incarnation=self.agent.incarnation,
                checkout_id=checkout_id,
                hold_s=self.max_pull_s,
            )
        finally:
            if not held:  # refused or cancelled before the hold began: nothing reads them
                await self.end_read(read)

    async def Checkin(
        self, request: nixl_pb2.NixlCheckinRequest, context: grpc.aio.ServicerContext
    ) -> nixl_pb2.NixlCheckinResponse:
        checkout = self._checkouts.get(request.checkout_id)
        if checkout is not None and checkout.request_id == request.request_id:
            await self._end(request.checkout_id)
        return nixl_pb2.NixlCheckinResponse()

    def _expire(self, checkout_id: str) -> None:
        """``max_pull_s`` passed without a Checkin: the hold ends (the lease rules apply)."""
        checkout = self._checkouts.get(checkout_id)
        if checkout is not None:
            logger.warning(
                "request_id=%s: NIXL checkout ended after max_pull_s=%s without a checkin",
                checkout.request_id,
                self.max_pull_s,
            )
        task = asyncio.get_running_loop().create_task(self._end(checkout_id))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end(self, checkout_id: str) -> None:
        checkout = self._checkouts.pop(checkout_id, None)
        if checkout is None:
            return
        if not self._checkouts:
            self._no_checkouts.set()
        checkout.timer.cancel()
        await self.end_read(checkout.read)
