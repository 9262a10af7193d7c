"""The router's calls to workers: prefill worker choice (cache-aware or load-only), the
Prefill call, decode admission (``router/decode_admission.py``), the relay of a worker's token
stream, lease renewal and release.

Lease ownership follows the contract in ``kvtransfer/base.py``; the router's part (ending a
lease no decode worker admitted) goes through the shared ``LeaseReleaser``. Every failed call
is classified by the one failure table (``router/failures.py``): a worker that failed raises
``WorkerLost``, which the router answers with a migration (``router/migration.py``), counted
against ``migration_limit`` whatever the phase.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from pdserve.common import metrics
from pdserve.common.lease_release import LeaseReleaser
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from router.cluster_state import ClusterState
from router.config import RouterConfig
from router.decode_admission import DecodeAdmission, Metadata
from router.failures import Action, Phase, Seen, classify
from router.plan import Facts, Plan, Pull, Route, plan
from router.policy import RoutingPolicy
from router.prefix_pricing import Holding, Rates
from router.pull_rate import PullRate
from router.worker import Worker
from router.worker_errors import (
    WorkerError,
    WorkerLost,
    event,
    failure,
    stalled,
    unserved,
    worker_error,
)
from router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Placement:
    """A plan (``router/plan.py``) with its addresses resolved to the snapshot's workers."""

    plan: Plan
    prefill: list[Worker]
    decode: list[Worker]


class Dispatcher:
    def __init__(self, config: RouterConfig, pool: WorkerPool, cluster: ClusterState) -> None:
        self.config = config
        self.pool = pool
        self.cluster = cluster
        self.releaser = LeaseReleaser(pool.channels)
        self.admission = DecodeAdmission(config, pool, self.renew)
        self.pull_rate = PullRate(config.peer_pull_tokens_per_s, config.peer_pull_overhead_s)
        # Prompt tokens per second per prefill worker, as flow control measures them (the
        # cost policy's price of computing); the prior until the router wires it.
        self.prefill_tokens_per_s: Callable[[], float] = lambda: config.flow.prefill_tokens_per_s

    async def close(self) -> None:
        await self.releaser.close()

    async def place(
        self,
        prompt_ids: list[int],
        avoid: frozenset[str] = frozenset(),
        exclude: frozenset[str] = frozenset(),
        local: bool = True,
    ) -> Placement:
        """Gathers the facts (load snapshots, the prefix index's cached tokens, the pools'
        turns), asks ``router/plan.py`` for the plan and resolves it to workers. Raises
        ``WorkerError`` when the plan has no worker to start with."""
        config, pool = self.config, self.pool
        # One snapshot: a worker may leave the pool while Redis answers.
        prefill = {} if config.colocated else {w.address: w for w in pool.prefill.values()}
        decode = {w.address: w for w in pool.decode.values()}
        stores = [] if config.colocated else list(pool.stores.values())
        index = self.cluster.index is not None
        cache_aware = config.prefill_policy is RoutingPolicy.CACHE_AWARE and index
        priced = config.prefill_policy is RoutingPolicy.COST and index
        local_lookup = local and not config.colocated and config.local_prefill_tokens > 0
        prefill_cached, decode_cached, holdings = await asyncio.gather(
            self._cached(prompt_ids, prefill.values(), cache_aware),
            self._cached(prompt_ids, decode.values(), local_lookup),
            self._holdings(prompt_ids, [*prefill.values(), *stores], priced),
        )
        facts = Facts(
            num_prompt_tokens=len(prompt_ids),
            prefill=tuple(w.load() for w in prefill.values()),
            decode=tuple(w.load() for w in decode.values()),
            prefill_cached=prefill_cached if cache_aware else None,
            decode_cached=decode_cached,
            prefill_turn=pool.peek_turn(Role.PREFILL),
            decode_turn=pool.peek_turn(Role.DECODE),
            avoid=avoid,
            exclude=exclude,
            local=local,
            prefill_holdings=holdings if priced else None,
            stores=tuple(w.load() for w in stores if w.routable) if priced else (),
            rates=self._rates() if priced else None,
        )
        chosen = plan(facts, config)
        # Each pool's rotation turns once per attempt that uses it: the prefill pool's when the
        # plan disaggregates (once per attempt), the decode pool's at the attempt's first plan
        # (a re-plan, after a worker turned the attempt away, keeps the turn it had).
        if chosen.route is Route.DISAGGREGATED:
            pool.next_turn(Role.PREFILL)
        if not exclude:
            pool.next_turn(Role.DECODE)
        self._count(chosen)
        if chosen.unserved is not None:
            raise unserved(chosen, len(prompt_ids))
        return Placement(
            chosen, [prefill[a] for a in chosen.prefill], [decode[a] for a in chosen.decode]
        )

    async def _cached(
        self, prompt_ids: list[int], workers: Iterable[Worker], wanted: bool
    ) -> dict[str, int]:
        healthy = [w for w in workers if w.routable]
        return await self.cluster.cached_tokens(prompt_ids, healthy) if wanted else {}

    async def _holdings(
        self, prompt_ids: list[int], workers: Iterable[Worker], wanted: bool
    ) -> dict[str, Holding]:
        healthy = [w for w in workers if w.routable]
        return await self.cluster.prefix_holdings(prompt_ids, healthy) if wanted else {}

    def _rates(self) -> Rates:
        pull_tokens_per_s, pull_overhead_s = self.pull_rate.price()
        return Rates(
            self.prefill_tokens_per_s(),
            pull_tokens_per_s,
            pull_overhead_s,
            self.config.host_load_tokens_per_s,
            self.pull_rate.measured,
            self.config.eviction_reuse,
        )

    def _count(self, chosen: Plan) -> None:
        """By the pool whose choice it was, and how: the prefill policy, or (a decode worker
        prefills) the route."""
        if chosen.route is Route.DISAGGREGATED:
            policy = self.config.prefill_policy.value
            metrics.ROUTING_DECISIONS.labels("prefill", policy, chosen.reason).inc()
        else:
            metrics.ROUTING_DECISIONS.labels("decode", chosen.route.value, chosen.reason).inc()

    async def prefill(
        self,
        request: prefill_pb2.PrefillRequest,
        placement: Placement,
        metadata: Metadata = (),
    ) -> tuple[Worker, prefill_pb2.PrefillResponse]:
        """The first of the plan's prefill workers that answers. One that fails, times out or
        stalls (its stats calls stop answering) raises ``WorkerLost``: the request migrates,
        counted like any other worker failure; one whose cache turns out too small (a ``NEXT``
        verdict) hands it to the next. ``metadata``: the request's trace context."""
        num_prompt_tokens = len(request.prompt_token_ids)
        predicted = placement.plan.cached_tokens
        turned_away: WorkerError | None = None
        for worker in placement.prefill:
            if worker.departed:  # left the pool (its channel may be closed) since the plan
                continue
            # The plan's pull is its first choice's (another worker prices it anew next time).
            sent = with_pull(request, placement.plan.pull, worker is placement.prefill[0])
            with self.pool.dispatched(worker, num_prompt_tokens - predicted):
                call = worker.prefill_stub.Prefill(
                    sent, timeout=self.config.prefill_timeout_s, metadata=metadata or None
                )
                what = f"prefill worker {worker.address}"
                try:
                    response = await self._unless_lost(call, worker)
                    if response.WhichOneof("outcome") is None:
                        raise WorkerError(
                            grpc.StatusCode.INTERNAL,
                            f"prefill worker {worker.address} answered neither a lease nor a "
                            "finish",
                        )
                    self.count_prefix(num_prompt_tokens, predicted, response.num_cached_tokens)
                    self.pull_rate.observe(response.num_pulled_tokens, response.pull_s)
                    return worker, response
                # Given up on (an error, a stall, the client gone), the call is cancelled: the
                # worker aborts the request. Had it just finished, its lease, whose token never
                # reached us, ends by expiry.
                except grpc.aio.AioRpcError as exc:
                    verdict = classify(Phase.PREFILL, event(exc))
                    if verdict.action is not Action.NEXT:
                        raise failure(exc, worker, what, verdict) from None
                    turned_away = worker_error(exc, what)
                finally:
                    call.cancel()  # no-op when done
            predicted = 0  # the prediction was for the first choice
        raise turned_away or WorkerError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")

    @staticmethod
    async def _unless_lost(call: Awaitable[T], worker: Worker) -> T:
        """Awaits a unary call, giving up (``WorkerLost``) if its worker turns unhealthy
        meanwhile: a frozen process answers no stats calls, and would otherwise hold the call
        until its deadline."""
        answer = asyncio.ensure_future(call)
        lost = asyncio.ensure_future(worker.lost.wait())
        try:
            await asyncio.wait({answer, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not answer.done():
                answer.cancel()
        if answer.done() and not answer.cancelled():
            return answer.result()
        raise stalled(worker, "stopped answering", Phase.PREFILL)

    def count_prefix(self, num_prompt_tokens: int, predicted: int, actual: int) -> None:
        """Splits uncached tokens into 'stale' (the index promised them) and 'none'."""
        block_size = self.config.layout.block_size
        usable = (num_prompt_tokens - 1) // block_size * block_size
        stale = max(predicted - actual, 0)
        metrics.PREFIX_MISSES.labels("stale").inc(stale)
        metrics.PREFIX_MISSES.labels("none").inc(max(usable - actual - stale, 0))
        metrics.PREFILL_TOKENS.inc(num_prompt_tokens - actual)

    async def relay(
        self, call: grpc.aio.UnaryStreamCall, worker: Worker
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """A worker's stream, message by message (heartbeats included), until its finish.
        ``WorkerLost`` when the worker fails, stays silent for ``stall_timeout_s``, or turns
        lost meanwhile (its stats stopped answering, or its engine completed no step for
        ``stall_timeout_s``: heartbeats from a worker whose step hangs prove nothing)."""
        lost = asyncio.ensure_future(worker.lost.wait())
        with self.pool.dispatched(worker):
            try:
                while True:
                    read = asyncio.ensure_future(call.read())
                    await asyncio.wait(
                        {read, lost},
                        timeout=self.config.stall_timeout_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if not read.done():
                        read.cancel()
                        what = "turned unhealthy" if lost.done() else "silent for stall_timeout_s"
                        raise stalled(worker, what, Phase.STREAM)
                    message = read.result()
                    if message == grpc.aio.EOF:
                        return
                    assert isinstance(message, decode_pb2.DecodeResponse)
                    yield message
                    if message.WhichOneof("event") == "finished":
                        return  # a break before EOF changes nothing
            except grpc.aio.AioRpcError as exc:
                verdict = classify(Phase.STREAM, event(exc))
                raise failure(exc, worker, f"decode worker {worker.address}", verdict) from None
            finally:
                lost.cancel()
                call.cancel()  # client gone or worker given up on: stop its request too

    async def renew(self, worker: Worker, request_id: str, lease_token: str) -> None:
        """Keeps the prefilled blocks while waiting for decode room; fails if they are gone."""
        request = prefill_pb2.RenewLeaseRequest(request_id=request_id, lease_token=lease_token)
        try:
            reply = await worker.prefill_stub.RenewLease(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            verdict = classify(Phase.RENEWAL, event(exc))
            what = f"prefill worker {worker.address} (renewal)"
            raise failure(exc, worker, what, verdict) from None
        if not reply.renewed:
            raise WorkerLost(
                grpc.StatusCode.UNAVAILABLE,
                f"the prefilled KV on {worker.address} expired while waiting for a decode worker",
                classify(Phase.RENEWAL, Seen.LEASE_ENDED),
                worker.address,
            )

    def release_later(self, worker: Worker, request_id: str, lease_token: str) -> None:
        self.releaser.release_later(worker.address, request_id, lease_token)


def with_pull(
    request: prefill_pb2.PrefillRequest, pull: Pull | None, first: bool
) -> prefill_pb2.PrefillRequest:
    """``request`` naming the plan's holder to pull the prompt's prefix from, when the plan
    chose a pull and this is its first choice; else ``request`` as it is."""
    if pull is None or not first:
        return request
    sent = prefill_pb2.PrefillRequest()
    sent.CopyFrom(request)
    sent.prefix.CopyFrom(
        prefill_pb2.PrefixSource(holder_address=pull.holder, num_blocks=pull.num_blocks)
    )
    return sent


def prefill_request(
    request_id: str, prompt_ids: list[int], num_generated: int, sampling: common_pb2.SamplingParams
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        num_generated_tokens=num_generated,
    )
