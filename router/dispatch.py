"""The router's calls to workers: prefill worker choice (cache-aware or load-only), the
Prefill call, decode admission with bounded retries, the relay of a worker's token stream,
lease renewal and release.

Lease ownership follows the contract in ``kvtransfer/base.py``; the router's part (ending a
lease no decode worker admitted) goes through the shared ``LeaseReleaser``. Every failed call
is classified by the one failure table (``router/failures.py``): a worker that failed raises
``WorkerLost``, which the router answers with a migration (``router/migration.py``), counted
against ``migration_limit`` whatever the phase.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import grpc

from pdserve.common import metrics
from pdserve.common.lease_release import LEASE_ENDED, LeaseReleaser
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from router.cluster_state import ClusterState
from router.config import RouterConfig
from router.failures import Action, Phase, Seen, Verdict, classify
from router.policy import RoutingPolicy, rank_cache_aware
from router.worker_pool import Role, Worker, WorkerPool

logger = logging.getLogger(__name__)

_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 0.25
T = TypeVar("T")


class WorkerError(Exception):
    """A worker's failure, already phrased for the client. ``never``: no worker could ever
    serve this request (too large for any of them): retrying is pointless."""

    def __init__(self, code: grpc.StatusCode, message: str, never: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.never = never


class WorkerLost(WorkerError):
    """A worker failed (a ``MIGRATE`` verdict of ``router/failures.py``): another worker can
    take the request over. The next attempt avoids ``avoid`` (the worker, and the prefill
    worker whose KV failed)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        verdict: Verdict,
        address: str,
        *,
        also_avoid: tuple[str, ...] = (),
    ) -> None:
        super().__init__(code, message)
        self.verdict = verdict
        self.address = address
        self.avoid = (address, *also_avoid)


def worker_error(exc: grpc.aio.AioRpcError, what: str) -> WorkerError:
    code = exc.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return WorkerError(code, exc.details() or code.name)
    return WorkerError(code, f"{what}: {exc.details() or code.name}")


def failure(
    exc: grpc.aio.AioRpcError,
    worker: Worker,
    what: str,
    verdict: Verdict,
    also_avoid: tuple[str, ...] = (),
) -> WorkerError:
    """What a failed call raises for its verdict: ``WorkerLost`` (migrate), else the client's
    error. A ``NEXT`` verdict is the caller's to act on before it gets here."""
    error = worker_error(exc, what)
    if verdict.action is not Action.MIGRATE:
        return error
    return WorkerLost(error.code, error.message, verdict, worker.address, also_avoid=also_avoid)


def stalled(worker: Worker, what: str, phase: Phase) -> WorkerLost:
    message = f"{worker.role.value} worker {worker.address}: {what}"
    verdict = classify(phase, Seen.STALL)
    return WorkerLost(grpc.StatusCode.UNAVAILABLE, message, verdict, worker.address)


def _lease_ended(exc: grpc.aio.AioRpcError) -> bool:
    return LEASE_ENDED in tuple(exc.trailing_metadata() or ())


class Dispatcher:
    def __init__(self, config: RouterConfig, pool: WorkerPool, cluster: ClusterState) -> None:
        self.config = config
        self.pool = pool
        self.cluster = cluster
        self.releaser = LeaseReleaser(pool.channels)

    async def close(self) -> None:
        await self.releaser.close()

    async def prefill(
        self, request: prefill_pb2.PrefillRequest, avoid: frozenset[str] = frozenset()
    ) -> tuple[Worker, prefill_pb2.PrefillResponse]:
        """A healthy prefill worker's answer (``avoid``: tried last). One that fails, times out
        or stalls (its stats calls stop answering) raises ``WorkerLost``: the request migrates,
        counted like any other worker failure; one whose cache turns out too small (a ``NEXT``
        verdict) hands it to the next."""
        prompt_ids = list(request.prompt_token_ids)
        workers, predicted = await self.choose_prefill(prompt_ids)
        # Only workers whose cache could hold the prompt (one whose stats have not come yet may):
        # a small one would answer RESOURCE_EXHAUSTED while a larger one can serve it.
        # ``check_capacity`` has refused prompts that no worker can hold.
        able = [w for w in workers if w.stats is None or w.load().can_hold(len(prompt_ids))]
        if workers and (not able or able[0] is not workers[0]):
            predicted = 0  # the prediction was for the first choice, which cannot serve it
        workers = able
        workers.sort(key=lambda w: w.address in avoid)  # stable: the ranking otherwise
        if not workers:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        turned_away: WorkerError | None = None
        for worker in workers:
            if worker.departed:  # left the pool (its channel may be closed) since the choice
                continue
            with self.pool.dispatched(worker, len(prompt_ids) - predicted):
                call = worker.prefill.Prefill(request, timeout=self.config.prefill_timeout_s)
                what = f"prefill worker {worker.address}"
                try:
                    response = await self._unless_lost(call, worker)
                    self.count_prefix(len(prompt_ids), predicted, response.num_cached_tokens)
                    return worker, response
                # Given up on (an error, a stall, the client gone), the call is cancelled: the
                # worker aborts the request. Had it just finished, its lease, whose token never
                # reached us, ends by expiry.
                except grpc.aio.AioRpcError as exc:
                    verdict = classify(Phase.PREFILL, exc.code())
                    if verdict.action is not Action.NEXT:
                        raise failure(exc, worker, what, verdict) from None
                    turned_away = worker_error(exc, what)
                finally:
                    call.cancel()  # no-op when done
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

    async def choose_prefill(self, prompt_ids: list[int]) -> tuple[list[Worker], int]:
        """Prefill workers best first, and the cached tokens predicted for the first."""
        policy = self.config.prefill_policy
        if policy is RoutingPolicy.CACHE_AWARE and self.cluster.index is not None:
            healthy = [w for w in self.pool.prefill.values() if w.load().healthy]
            # Looked up in this snapshot: a worker may leave the pool while Redis answers.
            by_address = {w.address: w for w in healthy}
            cached = await self.cluster.cached_tokens(prompt_ids, healthy)
            if cached:
                choice = rank_cache_aware(
                    [w.load() for w in healthy],
                    cached,
                    self.config.cache_alpha,
                    self.config.imbalance_tokens,
                    self.pool.next_turn(Role.PREFILL),
                )
                metrics.ROUTING_DECISIONS.labels("prefill", policy.value, choice.reason).inc()
                return [by_address[a] for a in choice.order], choice.cached_tokens
        reason = "load" if policy is not RoutingPolicy.CACHE_AWARE else "no_index"
        metrics.ROUTING_DECISIONS.labels("prefill", policy.value, reason).inc()
        return self.pool.ranked_prefill(), 0

    async def choose_local(
        self,
        prompt_ids: list[int],
        tried: frozenset[str] = frozenset(),
        avoid: frozenset[str] = frozenset(),
    ) -> Worker | None:
        """Conditional disaggregation: the decode worker that should prefill this prompt itself
        (its uncached part is under ``local_prefill_tokens``), or None to disaggregate. When
        colocated, always a worker (not one of ``tried``, which turned the request away); those
        in ``avoid`` (it failed there before) come last."""
        threshold = self.config.local_prefill_tokens
        if threshold <= 0 and not self.config.colocated:
            return None
        # Colocated, this is the request's one decode choice; otherwise a peek (admit advances).
        workers = self.pool.ranked_decode(len(prompt_ids), advance=self.config.colocated)
        workers = [w for w in workers if w.address not in tried]
        workers.sort(key=lambda w: w.address in avoid)
        if not workers:
            if not self.config.colocated:
                return None
            if tried or not any(w.healthy for w in self.pool.decode.values()):
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, "no healthy colocated worker")
            raise WorkerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no colocated worker can hold {len(prompt_ids)} prompt tokens",
                never=True,
            )
        if self.config.colocated:  # every prompt, whatever is cached: load-ranked choice
            metrics.ROUTING_DECISIONS.labels("decode", "colocated", "colocated").inc()
            return workers[0]
        cached = await self.cluster.cached_tokens(prompt_ids, workers)
        best = max(workers, key=lambda w: cached.get(w.address, 0))  # ties: ranked order
        if len(prompt_ids) - cached.get(best.address, 0) >= threshold:
            return None
        metrics.ROUTING_DECISIONS.labels("decode", "conditional", "local_prefill").inc()
        return best

    def count_prefix(self, num_prompt_tokens: int, predicted: int, actual: int) -> None:
        """Splits uncached tokens into 'stale' (the index promised them) and 'none'."""
        usable = (num_prompt_tokens - 1) // self.config.block_size * self.config.block_size
        stale = max(predicted - actual, 0)
        metrics.PREFIX_MISSES.labels("stale").inc(stale)
        metrics.PREFIX_MISSES.labels("none").inc(max(usable - actual - stale, 0))
        metrics.PREFILL_TOKENS.inc(num_prompt_tokens - actual)

    async def admit(
        self,
        request: decode_pb2.DecodeRequest,
        prefill_worker: Worker,
        avoid: frozenset[str] = frozenset(),
    ) -> tuple[grpc.aio.UnaryStreamCall, Worker, float]:
        """A decode worker that admitted the request and pulled its KV (its first message).
        Retries while every worker is full, renewing the lease, up to admission_timeout_s.
        ``WorkerLost`` when the handle is spent (a pull failed, or a worker stalled in it)."""
        num_prompt_tokens = len(request.prompt_token_ids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.admission_timeout_s
        delay_s = _RETRY_FIRST_S
        while True:
            workers = self.pool.ranked_decode(num_prompt_tokens)
            workers.sort(key=lambda w: w.address in avoid)
            if not workers:
                if not any(w.healthy for w in self.pool.decode.values()):
                    raise WorkerError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
                raise WorkerError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no decode worker can hold {num_prompt_tokens} prompt tokens",
                    never=True,
                )
            denials: list[str] = []
            for worker in workers:
                if worker.departed:
                    continue
                try:
                    with self.pool.dispatched(worker):
                        admitted = await self._admission(request, worker, prefill_worker)
                except _Denied as exc:
                    # A decode worker that does not know this prefill worker yet (just
                    # registered) refuses it; another may know it. Refused by all: final.
                    denials.append(str(exc))
                    continue
                if admitted is not None:
                    return admitted
            if denials and len(denials) == sum(not w.departed for w in workers):
                raise WorkerError(grpc.StatusCode.PERMISSION_DENIED, denials[0])
            if loop.time() + delay_s > deadline:
                raise WorkerError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no decode worker had room for {num_prompt_tokens} prompt tokens within "
                    f"admission_timeout_s={self.config.admission_timeout_s}",
                )
            await self.renew(prefill_worker, request.request_id, request.handle.lease_token)
            # Backoff: blocks free as other requests finish; the stats refresh sees it too.
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _RETRY_MAX_S)

    async def _admission(
        self, request: decode_pb2.DecodeRequest, worker: Worker, prefill_worker: Worker
    ) -> tuple[grpc.aio.UnaryStreamCall, Worker, float] | None:
        """One decode worker's answer: admitted (its call, after the KV pull), None when it is
        full or turned the request away (try another), ``WorkerLost`` when the handle may be
        spent (re-prefill), else the client's error. Heartbeats come during the pull; each
        silence is bounded by ``stall_timeout_s``. A prefill worker that freezes during the
        pull (its stats stop answering: ``Worker.lost``) is given up on the same way: the
        decode worker's pull would otherwise wait for its own transfer timeout."""
        call = worker.decode.Decode(request)
        what = f"decode worker {worker.address}"
        try:
            while True:
                message = await self._read_unless_lost(call, prefill_worker)
                if message == grpc.aio.EOF:
                    raise WorkerError(grpc.StatusCode.INTERNAL, "decode stream ended at once")
                assert isinstance(message, decode_pb2.DecodeResponse)
                if message.admitted:
                    return call, worker, message.transfer_s
        except TimeoutError:
            call.cancel()
            raise stalled(worker, "admission silent for stall_timeout_s", Phase.ADMISSION) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            verdict = classify(Phase.ADMISSION, Seen.LEASE_ENDED if _lease_ended(exc) else code)
            if verdict.action is not Action.NEXT:
                also = (prefill_worker.address,) if verdict.avoid_prefill else ()
                raise failure(exc, worker, what, verdict, also) from None
            if code == grpc.StatusCode.PERMISSION_DENIED:
                raise _Denied(f"{what}: {exc.details()}") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                metrics.DECODE_RETRIES.inc()
            return None  # full, draining or gone before the pull: another worker takes it
        except BaseException:
            call.cancel()
            raise

    async def _read_unless_lost(
        self, call: grpc.aio.UnaryStreamCall, prefill_worker: Worker
    ) -> object:
        """The call's next message; ``TimeoutError`` after ``stall_timeout_s`` of silence;
        ``WorkerLost`` (a stall of the prefill worker) if the prefill worker turns lost."""
        read = asyncio.ensure_future(call.read())
        lost = asyncio.ensure_future(prefill_worker.lost.wait())
        try:
            await asyncio.wait(
                {read, lost},
                timeout=self.config.stall_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            lost.cancel()
            if not read.done():
                read.cancel()
        if read.done() and not read.cancelled():
            return read.result()
        if prefill_worker.lost.is_set():
            raise stalled(prefill_worker, "stopped answering during the KV pull", Phase.ADMISSION)
        raise TimeoutError

    async def relay(
        self, call: grpc.aio.UnaryStreamCall, worker: Worker
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """A worker's stream, message by message (heartbeats included), until its finish.
        ``WorkerLost`` when the worker fails or stays silent for ``stall_timeout_s``."""
        with self.pool.dispatched(worker):
            try:
                while True:
                    async with asyncio.timeout(self.config.stall_timeout_s):
                        message = await call.read()
                    if message == grpc.aio.EOF:
                        return
                    assert isinstance(message, decode_pb2.DecodeResponse)
                    yield message
                    if message.finish_reason:
                        return  # finished: a break before EOF changes nothing
            except TimeoutError:
                raise stalled(worker, "silent for stall_timeout_s", Phase.STREAM) from None
            except grpc.aio.AioRpcError as exc:
                verdict = classify(Phase.STREAM, exc.code())
                raise failure(exc, worker, f"decode worker {worker.address}", verdict) from None
            finally:
                call.cancel()  # client gone or worker given up on: stop its request too

    async def renew(self, worker: Worker, request_id: str, lease_token: str) -> None:
        """Keeps the prefilled blocks while waiting for decode room; fails if they are gone."""
        request = prefill_pb2.RenewLeaseRequest(request_id=request_id, lease_token=lease_token)
        try:
            reply = await worker.prefill.RenewLease(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            verdict = classify(Phase.RENEWAL, exc.code())
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


def prefill_request(
    request_id: str, prompt_ids: list[int], num_generated: int, sampling: common_pb2.SamplingParams
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        num_generated_tokens=num_generated,
    )


class _Denied(Exception):
    """A decode worker refused the request's KV source (``decode_service/peers.py``)."""
