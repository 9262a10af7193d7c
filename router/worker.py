"""One worker as the router sees it: its stubs, in-flight counts and refreshed stats, and
whether it may be routed to (``Worker``); and the one rule that refuses a worker of another
model or wire (``worker_refusal``). ``router/worker_pool.py`` keeps them in pools."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

import grpc

from engine.kv_layout import KVCacheLayout
from pdserve.common.channels import ChannelPool
from pdserve.common.convert import layout_from_proto
from pdserve.common.role import Role
from pdserve.common.wire_version import WIRE_VERSION
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.policy import WorkerLoad, engine_stalled, is_stalled

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 2.0


def worker_refusal(
    wire_version: int,
    fingerprint: str,
    block_size: int,
    want_fingerprint: str,
    want_block_size: int,
) -> str | None:
    """Why a worker cannot serve this router's requests (it speaks another internal wire, its
    KV blocks hold another model, or are cut at another size), or None. The one rule for
    registry records and for the stats of static workers, whose addresses come from the
    command line and name no model."""
    if wire_version != WIRE_VERSION:
        return f"it speaks wire version {wire_version}, this router {WIRE_VERSION}"
    if fingerprint == want_fingerprint and block_size == want_block_size:
        return None
    return (
        f"fingerprint {fingerprint} block_size {block_size}, "
        f"router has {want_fingerprint} block_size {want_block_size}"
    )


@dataclass
class Worker:
    address: str
    role: Role
    channels: ChannelPool  # stubs follow the pool's channel (renewed certificates, resets)
    worker_id: str = ""  # registry id (the prefix index key); the address for static workers
    num_inflight: int = 0
    queued_prefill_tokens: int = 0
    stats: common_pb2.WorkerStats | None = None
    kv_layout: KVCacheLayout | None = None  # its stats' layout, read (the pairing rule's)
    healthy: bool = False
    draining: bool = False  # from the registry: no new work
    record_expired: bool = False  # from the registry: it stopped heartbeating
    num_stats_timeouts: int = 0  # in a row
    # A call to it just failed or stalled: no new work until its next stats call answers.
    suspected: bool = False
    # Its stats name another model or block size (``worker_refusal``): never routable.
    refused: str = ""
    departed: bool = False  # gone from the pool (its channel closes once nothing is in flight)
    # Set while the worker is unhealthy: calls in flight to it give up (and are retried).
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    _channel: grpc.aio.Channel | None = field(default=None, init=False, repr=False)
    _stubs: tuple[prefill_pb2_grpc.PrefillWorkerStub, decode_pb2_grpc.DecodeWorkerStub] = field(
        init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.worker_id = self.worker_id or self.address
        self.set_healthy(self.healthy)

    def _current_stubs(
        self,
    ) -> tuple[prefill_pb2_grpc.PrefillWorkerStub, decode_pb2_grpc.DecodeWorkerStub]:
        """Stubs on the pool's current channel: a retired one (after a certificate renewal)
        closes after its grace, so none is kept past it."""
        channel = self.channels.get(self.address)
        if channel is not self._channel:
            self._channel = channel
            stubs = (
                prefill_pb2_grpc.PrefillWorkerStub(channel),
                decode_pb2_grpc.DecodeWorkerStub(channel),
            )
            self._stubs = stubs
        return self._stubs

    @property
    def prefill_stub(self) -> prefill_pb2_grpc.PrefillWorkerStub:
        return self._current_stubs()[0]

    @property
    def decode_stub(self) -> decode_pb2_grpc.DecodeWorkerStub:
        return self._current_stubs()[1]

    def track(self, call: grpc.aio.Call) -> None:
        """``call`` was just made on a stub of this worker's (no await since): its channel
        stays open, even once retired, until the call ends (``ChannelPool.track``)."""
        assert self._channel is not None
        self.channels.track(self._channel, call)

    def load(self) -> WorkerLoad:
        stats = self.stats
        return WorkerLoad(
            address=self.address,
            num_inflight=self.num_inflight,
            num_free_blocks=stats.num_free_blocks if stats else 0,
            num_blocks=stats.num_blocks if stats else 0,
            block_size=stats.block_size if stats and stats.block_size else 1,
            routable=self.routable,
            queued_prefill_tokens=self.queued_prefill_tokens,
            num_cached_blocks=stats.num_cached_blocks if stats else 0,
            stats_known=stats is not None,
            kv_layout=self.kv_layout,
        )

    @property
    def routable(self) -> bool:
        stats_draining = self.stats is not None and self.stats.draining
        routing_ok = not self.suspected and not self.draining and not self.refused
        return self.healthy and routing_ok and not stats_draining

    def set_healthy(self, healthy: bool, why: str = "") -> None:
        if self.healthy and not healthy:
            logger.warning("%s worker %s unhealthy: %s", self.role.value, self.address, why)
        elif healthy and not self.healthy and self.stats is not None:
            logger.info("%s worker %s healthy again", self.role.value, self.address)
        self.healthy = healthy
        if healthy:
            self.lost.clear()
        else:
            self.lost.set()

    async def refresh(
        self, fingerprint: str, block_size: int, stall_timeout_s: float = math.inf
    ) -> None:
        """Asks for its stats; ``fingerprint`` and ``block_size`` are the router's, which its
        stats' layout must match (a restart at the same address may bring another model); an
        engine that completed no step for ``stall_timeout_s`` makes it unhealthy."""
        # A KV store answers the holder half of the prefill worker's service.
        stub = self.decode_stub if self.role is Role.DECODE else self.prefill_stub
        try:
            self.stats = await stub.GetStats(common_pb2.GetStatsRequest(), timeout=_STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            timed_out = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            self.num_stats_timeouts = self.num_stats_timeouts + 1 if timed_out else 0
            if timed_out and self.stats is not None:
                if not is_stalled(self.num_stats_timeouts, self.record_expired):
                    return  # a busy worker, for now: keep its last state
                self.set_healthy(False, f"{self.num_stats_timeouts} stats calls timed out")
                return
            self.set_healthy(False, exc.code().name)
            return
        self.num_stats_timeouts = 0
        layout = self.stats.layout
        try:
            self.kv_layout = layout_from_proto(layout)
        except ValueError:  # refused below by its fingerprint, or unreadable: pairs with none
            self.kv_layout = None
        refused = (
            worker_refusal(
                self.stats.wire_version,
                layout.model_fingerprint,
                layout.block_size,
                fingerprint,
                block_size,
            )
            or ""
        )
        if refused and refused != self.refused:
            logger.error("refusing %s worker at %s: %s", self.role.value, self.address, refused)
        elif self.refused and not refused:
            logger.info("%s worker %s now matches the router", self.role.value, self.address)
        self.refused = refused
        self.suspected = False
        stalled_s = self.stats.engine_stalled_s
        if engine_stalled(stalled_s, stall_timeout_s):
            self.set_healthy(False, f"its engine completed no step for {stalled_s:.1f} s")
            return
        self.set_healthy(True)
