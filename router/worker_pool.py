"""The router's view of its workers: stubs, in-flight counts, refreshed stats, and (with Redis)
membership that follows the registry: workers appear, drain and leave at runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from engine.kv_layout import KVCacheLayout
from pdserve.cluster.registry import WorkerRecord, WorkerState
from pdserve.common import metrics
from pdserve.common.channels import ChannelPool
from pdserve.common.convert import layout_from_proto
from pdserve.common.role import Role
from pdserve.common.tls import TlsConfig
from pdserve.common.wire_version import WIRE_VERSION
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.policy import (
    RoutingPolicy,
    WorkerLoad,
    engine_stalled,
    is_stalled,
    rank_decode,
)

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 2.0

__all__ = ["Worker", "WorkerPool"]


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


class WorkerPool:
    def __init__(
        self,
        prefill: tuple[str, ...] = (),
        decode: tuple[str, ...] = (),
        decode_policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED,
        tls: TlsConfig | None = None,
        stall_timeout_s: float = math.inf,
    ) -> None:
        self.channels = ChannelPool(tls=tls)
        self.stall_timeout_s = stall_timeout_s  # an engine this long without a step: unhealthy
        self.decode_policy = decode_policy
        # KV stores (docs/kv-cache.md) are holders a prefill worker may pull from, never routed
        # to: kept apart from ``workers``, their stats refreshed like a worker's.
        self.pools: dict[Role, dict[str, Worker]] = {
            Role.PREFILL: {},
            Role.DECODE: {},
            Role.KVSTORE: {},
        }
        for role, addresses in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            for address in addresses:
                self.pools[role][address] = Worker(address, role, self.channels)
        self._static = {*prefill, *decode}
        self._refused: dict[str, Role] = {}  # registry workers refused: worker_id -> role
        self._departed: list[Worker] = []  # their channels close once nothing is in flight
        # One rotation per pool: a shared counter would advance by two per request and pin
        # round-robin to every other worker.
        self._turns = {Role.PREFILL: 0, Role.DECODE: 0}

    @property
    def prefill(self) -> dict[str, Worker]:
        return self.pools[Role.PREFILL]

    @property
    def decode(self) -> dict[str, Worker]:
        return self.pools[Role.DECODE]

    @property
    def stores(self) -> dict[str, Worker]:
        return self.pools[Role.KVSTORE]

    @property
    def workers(self) -> list[Worker]:
        """The prefill and decode workers (not the stores)."""
        return [*self.prefill.values(), *self.decode.values()]

    def sync(
        self,
        records: list[WorkerRecord],
        fingerprint: str,
        block_size: int,
        heartbeating: bool = True,
    ) -> None:
        """Follow the registry: add new workers (if their KV layout matches), mark draining
        ones, and drop those whose record is gone once they are also draining or unhealthy.
        (A record can vanish while its worker is fine, e.g. just after a Redis restart and
        before the next heartbeat; dropping a healthy worker then would drop traffic. Its
        next stats timeout, though, marks it stalled at once.) Static workers stay.
        ``heartbeating=False``: remembered records (``pdserve/cluster/last_known.py``), whose
        workers are routable only once their stats answer."""
        seen: set[str] = set()
        for record in records:
            pool = self.pools[record.role]
            refused = worker_refusal(
                record.wire_version,
                record.model_fingerprint,
                record.block_size,
                fingerprint,
                block_size,
            )
            if refused is not None:
                self._refuse(record, refused)
                continue
            seen.add(record.address)
            worker = pool.get(record.address)
            if worker is None:
                # It heartbeats; stats follow at the next refresh.
                worker = Worker(
                    record.address,
                    record.role,
                    self.channels,
                    record.worker_id,
                    healthy=heartbeating,
                )
                pool[record.address] = worker
                logger.info("%s worker %s joined", record.role.value, record.address)
            worker.worker_id = record.worker_id  # a restart on the same address gets a new id
            worker.draining = record.state is WorkerState.DRAINING
            worker.record_expired = False
        for pool in self.pools.values():
            for address, worker in list(pool.items()):
                if address in seen or address in self._static:
                    continue
                worker.record_expired = True
                if worker.draining or not worker.healthy:
                    logger.info("%s worker %s left", worker.role.value, address)
                    self._depart(pool, address)
        # Forget refusals of workers that are gone, so the set does not grow forever.
        ids = {r.worker_id for r in records}
        self._refused = {i: role for i, role in self._refused.items() if i in ids}

    def _refuse(self, record: WorkerRecord, why: str) -> None:
        if record.worker_id not in self._refused:
            self._refused[record.worker_id] = record.role
            logger.error("refusing worker_id=%s at %s: %s", record.worker_id, record.address, why)
        # An incompatible worker now answers at this address: the old entry is not it.
        stale = self.pools[record.role].get(record.address)
        if stale is not None and record.address not in self._static:
            logger.info("%s worker %s replaced by a refused one", record.role.value, stale.address)
            stale.set_healthy(False, "replaced by an incompatible worker")
            self._depart(self.pools[record.role], record.address)

    def _depart(self, pool: dict[str, Worker], address: str) -> None:
        worker = pool.pop(address)
        worker.departed = True
        self._departed.append(worker)

    async def close_unused_channels(self) -> None:
        """Closes channels to peers that left once nothing is in flight to them (a draining
        worker's last streams finish first). Call after ``sync``."""
        self._departed = [w for w in self._departed if w.num_inflight > 0]
        in_use = {w.address for w in [*self.workers, *self.stores.values(), *self._departed]}
        await self.channels.retain(in_use | self._static)

    async def refresh(self, fingerprint: str, block_size: int) -> None:
        stall_s = self.stall_timeout_s
        everyone = [*self.workers, *self.stores.values()]
        await asyncio.gather(*(w.refresh(fingerprint, block_size, stall_s) for w in everyone))
        for role, pool in self.pools.items():
            workers = pool.values()
            metrics.HEALTHY_WORKERS.labels(role.value).set(sum(w.routable for w in workers))
            refused = sum(bool(w.refused) for w in workers)  # static ones, found by stats
            refused += sum(r is role for r in self._refused.values())  # never admitted
            metrics.REFUSED_WORKERS.labels(role.value).set(refused)

    def suspect(self, address: str, why: str) -> None:
        """A call to this worker just failed or stalled: no new work for it until its next
        stats call answers (within ``stats_interval_s`` if it is fine after all). Calls in
        flight to it go on: only stats timeouts (``lost``) stop those."""
        for pool in self.pools.values():
            worker = pool.get(address)
            if worker is not None and not worker.suspected:
                logger.warning("%s worker %s suspected: %s", worker.role.value, address, why)
                worker.suspected = True

    async def wait_healthy(
        self, needs_prefill: bool, timeout_s: float, poll_s: float = 0.05
    ) -> bool:
        """Until each needed pool has a healthy worker (a restarted one rejoins), at most
        ``timeout_s``; False if it did not happen."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.ready(needs_prefill):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def ready(self, needs_prefill: bool = True) -> bool:
        prefill = any(w.routable for w in self.prefill.values()) or not needs_prefill
        return prefill and any(w.routable for w in self.decode.values())

    def readiness(self, needs_prefill: bool = True) -> str:
        """What ``ready`` lacks, for the start-up log: routable / known per pool."""
        roles = (Role.PREFILL, Role.DECODE) if needs_prefill else (Role.DECODE,)
        return ", ".join(
            f"{sum(w.routable for w in self.pools[r].values())} of "
            f"{len(self.pools[r])} {r.value} workers routable"
            for r in roles
        )

    @property
    def max_model_len(self) -> int:
        """The smallest limit among workers that reported one (both phases must fit)."""
        lens = [w.stats.max_model_len for w in self.workers if w.stats is not None]
        return min(lens) if lens else 0

    def ranked_decode(self, num_prompt_tokens: int) -> list[Worker]:
        """Decode workers that could hold the prompt, best first (an admission retry's order;
        the first comes with the plan, ``router/plan.py``)."""
        turn = self.next_turn(Role.DECODE)
        loads = [w.load() for w in self.decode.values()]
        order = rank_decode(loads, num_prompt_tokens, turn, self.decode_policy)
        return [self.decode[a] for a in order]

    def next_turn(self, role: Role) -> int:
        self._turns[role] += 1
        return self._turns[role]

    def peek_turn(self, role: Role) -> int:
        """The turn ``next_turn`` would take, without taking it."""
        return self._turns[role] + 1

    @contextlib.contextmanager
    def dispatched(self, worker: Worker, num_prefill_tokens: int = 0) -> Iterator[Worker]:
        worker.num_inflight += 1
        worker.queued_prefill_tokens += num_prefill_tokens
        try:
            yield worker
        finally:
            worker.num_inflight -= 1
            worker.queued_prefill_tokens -= num_prefill_tokens

    async def close(self) -> None:
        await self.channels.close()
