"""The front-end's end of the control channel to vLLM's processes
(``proto/pdserve/v1/engine_hub.proto``; the ranks' end is ``vllm_engine/rank_runtime.py``, the
engine core's ``vllm_engine/core_channel.py``).

One per vLLM engine whose ranks run in processes of their own (tensor_parallel_size > 1, or an
engine core in a process of its own), started before vLLM builds them: each rank says hello
once its KV cache is registered, then the hub is how the front-end commands them (start a
sender or receiver, pull a request's shard, cancel it, report to vLLM) and how their senders
reach the one lease table (``Checkout``/``Checkin`` on the prefill service's
``LeaseManager``). An engine core in a process of its own says here which blocks vLLM gave a
request (``Allocated``, ``Pinned``), handed to the engine's ``Bridge``. gRPC on a Unix socket
in a directory only this user may enter.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine.kv_layout import KVCacheLayout
from engine.structured_output import StructuredOutput
from kvtransfer.base import BlockLeases
from pdserve.common.convert import layout_from_proto, structured_to_proto
from pdserve.v1 import engine_hub_pb2 as hub_pb2
from pdserve.v1 import engine_hub_pb2_grpc as hub_grpc
from vllm_engine.bridge import Bridge, Reports

logger = logging.getLogger(__name__)

RANK_CALL_TIMEOUT_S = 10.0
# A grammar the front-end compiled within pdserve's limits compiles in a rank as fast (the
# rank warmed its token table before it said hello); past this a rank busy stepping is left
# to compile it in its step.
COMPILE_TIMEOUT_S = 30.0
_MAX_ENDED = 4096  # a command a rank does not answer in this is a dead engine


@dataclass(frozen=True)
class Rank:
    tp_rank: int
    pid: int
    layout: KVCacheLayout  # its shard
    stub: hub_grpc.RankControlStub


class RankHub(hub_grpc.EngineHubServicer):
    def __init__(self, tp_size: int, bridge: Bridge | None = None) -> None:
        self.tp_size = tp_size
        self._bridge = bridge  # None: only ranks dial (the engine core is the worker's)
        # Told of a pin the engine core made (its request's output may be here first, or
        # the request gone: the table decides).
        self.on_pinned: Callable[[str, int], None] | None = None  # (rid, attempt)
        self.socket_dir = tempfile.mkdtemp(prefix="pdserve-ranks-")  # mode 0700
        self.address = f"unix://{self.socket_dir}/hub.sock"
        self.ranks: dict[int, Rank] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._all_ranks = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        # The lease table rank senders check out from (the prefill service's, once it starts
        # its sender; a decode worker's ranks never ask).
        self.leases: BlockLeases | None = None
        self._checkouts: dict[str, str] = {}  # checkout id -> request id
        # Checkins that overtook their Checkout (a rank gave up waiting): it is refused.
        self._ended: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> None:
        self._server = grpc.aio.server()
        hub_grpc.add_EngineHubServicer_to_server(self, self._server)
        self._server.add_insecure_port(self.address)
        await self._server.start()

    async def wait_ranks(self, timeout_s: float) -> list[Rank]:
        """Every rank, in rank order, once each said hello (``TimeoutError`` past the bound)."""
        async with asyncio.timeout(timeout_s):
            await self._all_ranks.wait()
        return [self.ranks[r] for r in range(self.tp_size)]

    @property
    def layout(self) -> KVCacheLayout:
        """The engine's layout: its rank 0's shard."""
        return self.ranks[0].layout

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
        for channel in self._channels:
            await channel.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    # ---- commands to every rank -------------------------------------------------------------
    async def report(self, reports: Reports) -> None:
        """What vLLM must be told, given to every rank (it frees or schedules once all did)."""
        if not (reports.finished_sending or reports.finished_recving):
            return
        request = hub_pb2.RankReport(
            finished_sending=sorted(reports.finished_sending),
            finished_recving=sorted(reports.finished_recving),
            failed_recving=sorted(reports.failed_recving),
        )
        await asyncio.gather(
            *(r.stub.Report(request, timeout=RANK_CALL_TIMEOUT_S) for r in self.ranks.values())
        )

    async def compile(self, spec: StructuredOutput) -> None:
        """Compiles a grammar in every rank (each off its step, in parallel), before its
        request is added: a rank's sampler then finds it compiled. ``ValueError`` when a rank
        cannot compile it; ``grpc.aio.AioRpcError`` for any other failure (UNAVAILABLE: a rank
        is gone)."""
        request = structured_to_proto(spec)
        try:
            await asyncio.gather(
                *(r.stub.Compile(request, timeout=COMPILE_TIMEOUT_S) for r in self.ranks.values())
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            raise

    # ---- EngineHub --------------------------------------------------------------------------
    async def Hello(
        self, request: hub_pb2.RankHello, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        layout = layout_from_proto(request.layout)
        if layout.tp_size != self.tp_size or request.tp_rank in self.ranks:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"rank {request.tp_rank} of tp_size {layout.tp_size}: this engine runs "
                f"tp_size {self.tp_size} and knows ranks {sorted(self.ranks)}",
            )
        channel = grpc.aio.insecure_channel(request.control_address)
        self._channels.append(channel)
        stub = hub_grpc.RankControlStub(channel)
        self.ranks[request.tp_rank] = Rank(request.tp_rank, request.pid, layout, stub)
        logger.info("vLLM rank %d (pid %d) is ready", request.tp_rank, request.pid)
        if len(self.ranks) == self.tp_size:
            self._all_ranks.set()
        return hub_pb2.HubAck()

    async def Allocated(
        self, request: hub_pb2.CoreBlocks, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        bridge = await self._engine_bridge(context)
        bridge.allocated(
            request.request_id,
            request.attempt,
            request.internal_id,
            list(request.block_ids),
            request.waits,
        )
        return hub_pb2.HubAck()

    async def Pinned(
        self, request: hub_pb2.CoreBlocks, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        bridge = await self._engine_bridge(context)
        bridge.pin(
            request.request_id, request.attempt, request.internal_id, list(request.block_ids)
        )
        if self.on_pinned is not None:  # at once: a stale pin is released before the next
            self.on_pinned(request.request_id, request.attempt)
        return hub_pb2.HubAck()

    async def _engine_bridge(self, context: grpc.aio.ServicerContext) -> Bridge:
        if self._bridge is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this engine's core is the worker's own"
            )
        assert self._bridge is not None
        return self._bridge

    async def Checkout(
        self, request: hub_pb2.HubCheckout, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubBlocks:
        if self.leases is None or request.checkout_id in self._ended:
            self._ended.pop(request.checkout_id, None)
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no lease for request_id {request.request_id!r}"
            )
        assert self.leases is not None
        try:
            block_ids = await self.leases.checkout(request.request_id, request.lease_token)
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no lease for request_id {request.request_id!r}"
            )
        self._checkouts[request.checkout_id] = request.request_id
        return hub_pb2.HubBlocks(block_ids=block_ids)

    async def Checkin(
        self, request: hub_pb2.HubCheckin, context: grpc.aio.ServicerContext
    ) -> hub_pb2.HubAck:
        """Ends one checkout, exactly once (an unknown id: its Checkout has not arrived)."""
        request_id = self._checkouts.pop(request.checkout_id, None)
        if request_id is None:
            self._ended[request.checkout_id] = None
            while len(self._ended) > _MAX_ENDED:
                self._ended.popitem(last=False)
        elif self.leases is not None:
            await self.leases.checkin(request_id)
        return hub_pb2.HubAck()
