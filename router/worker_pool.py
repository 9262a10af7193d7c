"""The router's pools of workers (``router/worker.py``: one worker as it sees it) and (with
Redis) membership that follows the registry: workers appear, drain and leave at runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator

from pdserve.cluster.registry import WorkerRecord, WorkerState
from pdserve.common import metrics
from pdserve.common.channels import ChannelPool
from pdserve.common.role import Role
from pdserve.common.tls import TlsConfig
from router.policy import RoutingPolicy, rank_decode
from router.worker import Worker, worker_refusal

logger = logging.getLogger(__name__)

__all__ = ["Worker", "WorkerPool"]


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
        roles = (Role.PREFILL, Role.DECODE, Role.KVSTORE)
        self.pools: dict[Role, dict[str, Worker]] = {role: {} for role in roles}
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
