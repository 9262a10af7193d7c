"""One tensor-parallel rank's side of pdserve's KV transfer, in the rank's own process.

vLLM runs each rank of a tensor-parallel engine in a process of its own, holding that rank's
shard of the KV cache (its KV heads of every block). pdserve's connector builds one
``RankRuntime`` there (``vllm_engine/connector.py``, the worker half), and the rank moves only its
own shard: a prefill rank serves it with a real ``kvtransfer`` sender, a decode rank pulls it
with a real receiver, each over the rank's own pages. What stays with the worker's front-end,
its one owner, is everything with a guarantee: the leases (a rank's sender checks out through
the front-end's lease table, ``HubLeases``), the pulls (commanded per request, ``RankControl``;
the rank reads the shards its heads hold from the prefill ranks that hold them, whatever their
``tp_size``: ``kvtransfer/shard_receiver.py``)
and what vLLM is told (``Report``: vLLM frees or schedules a request only once every rank has
reported it, ``vllm_engine/bridge.py``).

Torch, ``kvtransfer``, the grammar compiler and gRPC only (no vLLM): tested with plain tensors
in the main venv. It also compiles each guided request's grammar before vLLM's step needs it
(``Compile``), into the rank's compiler, which its sampler reads. The runtime runs an event
loop in a daemon thread: vLLM's step runs in the rank's main thread and never waits for it
(``take_reports`` is a lock and a swap).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

import grpc

from engine.guide import GuideCompiler
from engine.kv_pages import KVPages
from kvtransfer import (
    KVReceiver,
    KVSender,
    KVTransferError,
    ReceiverOptions,
    SenderOptions,
    TransferErrorCode,
    make_sender,
)
from kvtransfer.base import BlockLeases
from kvtransfer.shard_receiver import ShardReceiver
from kvtransfer.wire import handle_from_proto
from pdserve.common.convert import layout_to_proto, structured_from_proto
from pdserve.common.tls import TlsConfig
from pdserve.v1 import common_pb2
from pdserve.v1 import engine_hub_pb2 as hub_pb2
from pdserve.v1 import engine_hub_pb2_grpc as hub_grpc
from vllm_engine.bridge import Reports

logger = logging.getLogger(__name__)

# Every call to the front-end is bounded: a front-end that stopped answering is a dead worker
# (its engine, and so this rank, goes with it).
HUB_CALL_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 60.0
_MAX_CANCELLED = 4096
RANK_BACKENDS = ("grpc", "nixl")  # what a rank can move its shard with (docs/engines.md)


def tls_to_proto(tls: TlsConfig | None) -> hub_pb2.RankTls | None:
    if tls is None:
        return None
    return hub_pb2.RankTls(
        cert_file=tls.cert_file,
        key_file=tls.key_file,
        ca_file=tls.ca_file or "",
        server_name=tls.server_name,
    )


def tls_from_proto(tls: hub_pb2.RankTls) -> TlsConfig:
    return TlsConfig(tls.cert_file, tls.key_file, tls.ca_file or None, tls.server_name)


class HubLeases(BlockLeases):
    """The front-end's lease table, as a rank's sender sees it: the checkout of one lease
    counts one reader there, whichever rank reads (the front-end's ``LeaseManager`` stays the
    one authority: no expiry while any rank reads, the free at the last checkin)."""

    def __init__(self, hub: hub_grpc.EngineHubStub) -> None:
        self._hub = hub
        self._held: dict[str, list[str]] = {}  # request id -> its checkouts' ids
        self._abandoning: set[asyncio.Task[None]] = set()

    async def checkout(self, request_id: str, lease_token: str) -> list[int]:
        checkout_id = uuid.uuid4().hex
        request = hub_pb2.HubCheckout(
            request_id=request_id, lease_token=lease_token, checkout_id=checkout_id
        )
        try:
            reply = await self._hub.Checkout(request, timeout=HUB_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                raise KeyError(request_id) from None
            raise
        except asyncio.CancelledError:
            # The front-end may have counted it: end it there, whether it did or not.
            task = asyncio.create_task(self._checkin(checkout_id))
            self._abandoning.add(task)
            task.add_done_callback(self._abandoning.discard)
            raise
        self._held.setdefault(request_id, []).append(checkout_id)
        return list(reply.block_ids)

    async def checkin(self, request_id: str) -> None:
        held = self._held[request_id]
        checkout_id = held.pop()
        if not held:
            del self._held[request_id]
        await self._checkin(checkout_id)

    async def _checkin(self, checkout_id: str) -> None:
        request = hub_pb2.HubCheckin(checkout_id=checkout_id)
        await self._hub.Checkin(request, timeout=HUB_CALL_TIMEOUT_S)


class RankRuntime(hub_grpc.RankControlServicer):
    """Built by the connector's worker half once vLLM registered this rank's KV caches;
    ``start`` returns once the front-end knows the rank (or raises: the rank cannot serve)."""

    def __init__(
        self,
        pages: KVPages,
        tp_rank: int,
        hub_address: str,
        socket_dir: str,
        guides: GuideCompiler | None = None,
    ) -> None:
        self.pages, self.tp_rank = pages, tp_rank
        # The rank's grammar compiler (its sampler's: ``vllm_engine/sampler.py``), which
        # ``Compile`` fills before a guided request reaches vLLM's step.
        self._guides = guides
        self._hub_address = hub_address
        self.control_address = f"unix://{os.path.join(socket_dir, f'rank-{tp_rank}.sock')}"
        self._lock = threading.Lock()
        self._reports = Reports()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"pdserve-rank-{tp_rank}", daemon=True
        )
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._sender: KVSender | None = None
        self._receiver: KVReceiver | None = None
        self._pulls: dict[str, asyncio.Task[Any]] = {}  # by pull id
        # Pulls cancelled before they arrived (a Cancel may overtake its Pull): refused.
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    # ---- the rank's main thread (vLLM's worker) ---------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._run(self._start(), _START_TIMEOUT_S)

    def take_reports(self) -> Reports:
        with self._lock:
            reports, self._reports = self._reports, Reports()
        return reports

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self._close(), HUB_CALL_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _run(self, coroutine: Coroutine[Any, Any, None], timeout_s: float) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    # ---- the runtime's loop -----------------------------------------------------------------
    async def _start(self) -> None:
        if self._guides is not None:
            # The token table, before the rank says it is ready: never in a step (~0.3 s).
            await asyncio.to_thread(self._guides.warm)
        self._server = grpc.aio.server()
        hub_grpc.add_RankControlServicer_to_server(self, self._server)
        self._server.add_insecure_port(self.control_address)
        await self._server.start()
        self._channel = grpc.aio.insecure_channel(self._hub_address)
        hello = hub_pb2.RankHello(
            tp_rank=self.tp_rank,
            pid=os.getpid(),
            control_address=self.control_address,
            layout=layout_to_proto(self.pages.layout),
        )
        await hub_grpc.EngineHubStub(self._channel).Hello(hello, timeout=HUB_CALL_TIMEOUT_S)

    async def _close(self) -> None:
        for task in list(self._pulls.values()):
            task.cancel()
        if self._sender is not None:
            await self._sender.stop()
        if self._receiver is not None:
            await self._receiver.close()
        if self._server is not None:
            await self._server.stop(grace=None)
        if self._channel is not None:
            await self._channel.close()

    def _hub(self) -> hub_grpc.EngineHubStub:
        assert self._channel is not None
        return hub_grpc.EngineHubStub(self._channel)

    # ---- RankControl ------------------------------------------------------------------------
    async def StartSender(
        self, request: hub_pb2.StartRankSender, context: grpc.aio.ServicerContext
    ) -> hub_pb2.RankSenderStarted:
        if self._sender is None:
            options = SenderOptions(
                request.host,
                request.port,
                advertise_host=request.advertise_host or None,
                tls=tls_from_proto(request.tls) if request.HasField("tls") else None,
                max_pull_s=request.max_pull_s,
                verify=not request.no_verify,
                ucx_tls=request.ucx_tls or None,
            )
            sender = make_sender(request.backend, self.pages, HubLeases(self._hub()), options)
            await sender.start()
            self._sender = sender
            logger.info(
                "rank %d: kv sender (%s) at %s", self.tp_rank, sender.backend, sender.address
            )
        return hub_pb2.RankSenderStarted(address=self._sender.address)

    async def StartReceiver(
        self, request: hub_pb2.StartRankReceiver, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        if self._receiver is None:
            options = ReceiverOptions(
                request.timeout_s,
                tls=tls_from_proto(request.tls) if request.HasField("tls") else None,
                verify=not request.no_verify,
                ucx_tls=request.ucx_tls or None,
            )
            self._receiver = ShardReceiver(request.backend, self.pages, options)
        return hub_pb2.HubAck()

    async def Pull(
        self, request: hub_pb2.RankPull, context: grpc.aio.ServicerContext
    ) -> hub_pb2.RankPulled:
        if self._receiver is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no receiver started")
        assert self._receiver is not None
        handle = handle_from_proto(request.handle)
        trace = tuple((h.key, h.value) for h in request.trace)
        pull_id = request.pull_id
        if pull_id in self._cancelled:
            del self._cancelled[pull_id]
            return hub_pb2.RankPulled(
                error_code=TransferErrorCode.UNAVAILABLE.value, error_message="cancelled"
            )
        task = asyncio.create_task(self._receiver.pull(handle, list(request.block_ids), trace))
        self._pulls[pull_id] = task
        task.add_done_callback(lambda done: self._pulled(pull_id, done))
        try:
            # Shielded: a Cancel stops it, and answers only once it stopped writing.
            stats = await asyncio.shield(task)
        except KVTransferError as exc:
            return hub_pb2.RankPulled(error_code=exc.code.value, error_message=exc.message)
        except asyncio.CancelledError:
            task.cancel()  # the caller is gone (or cancelled it): stop writing
            raise
        return hub_pb2.RankPulled(num_bytes=stats.num_bytes, duration_s=stats.duration_s)

    def _pulled(self, pull_id: str, task: asyncio.Task[Any]) -> None:
        if self._pulls.get(pull_id) is task:
            del self._pulls[pull_id]

    async def Cancel(
        self, request: hub_pb2.RankCancel, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        task = self._pulls.get(request.pull_id)
        if task is None:
            self._cancelled[request.pull_id] = None
            while len(self._cancelled) > _MAX_CANCELLED:  # those whose Pull was never sent
                self._cancelled.popitem(last=False)
        else:
            task.cancel()
            await asyncio.wait([task])  # the receiver's contract: returned means not writing
        return hub_pb2.HubAck()

    async def Report(
        self, request: hub_pb2.RankReport, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        with self._lock:
            self._reports.finished_sending.update(request.finished_sending)
            self._reports.finished_recving.update(request.finished_recving)
            self._reports.failed_recving.update(request.failed_recving)
        return hub_pb2.HubAck()

    async def Compile(
        self, request: common_pb2.StructuredOutput, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        if self._guides is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this rank samples no grammar")
        assert self._guides is not None
        try:
            spec = structured_from_proto(request)
            await asyncio.to_thread(self._guides.compile, spec)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return hub_pb2.HubAck()

    async def RetainPeers(
        self, request: hub_pb2.RankPeers, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        if self._receiver is not None:
            await self._receiver.retain_peers(set(request.kv_addresses))
        return hub_pb2.HubAck()
