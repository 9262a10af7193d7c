"""Decode admission: the router hands a prefilled request to a decode worker, which reserves
blocks and pulls the KV (the ``Decode`` call until its admitted event), tried in the plan's
order, retried with backoff while every worker is full (the lease renewed meanwhile) up to
``admission_timeout_s``, each silence bounded by ``stall_timeout_s``. Failures are classified
by the failure table (``router/failures.py``), phase ``ADMISSION``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from pdserve.common import metrics
from pdserve.v1 import decode_pb2
from router.config import RouterConfig
from router.failures import Action, Phase, classify
from router.worker import Worker
from router.worker_errors import WorkerError, event, failure, stalled
from router.worker_pool import WorkerPool

_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 0.25
Metadata = tuple[tuple[str, str], ...]  # a call's extra metadata (the trace context)


class DecodeAdmission:
    """Owned by the ``Dispatcher``; ``renew`` is its lease renewal (the prefill worker's)."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        renew: Callable[[Worker, str, str], Awaitable[None]],
    ) -> None:
        self.config = config
        self.pool = pool
        self.renew = renew

    async def admit(
        self,
        request: decode_pb2.DecodeRequest,
        prefill_worker: Worker,
        candidates: list[Worker],
        avoid: frozenset[str] = frozenset(),
        metadata: Metadata = (),
    ) -> tuple[grpc.aio.UnaryStreamCall, Worker, decode_pb2.Admitted]:
        """A decode worker that admitted the request and pulled its KV (its first message),
        tried in the plan's order (``candidates``) first. Retries while every worker is full,
        renewing the lease, up to admission_timeout_s, re-ranked each time. ``WorkerLost``
        when the handle is spent (a pull failed, or a worker stalled in it). Returns the call,
        its worker and its admitted event (the worker's timings); ``metadata``: the trace
        context."""
        num_prompt_tokens = len(request.prompt_token_ids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.admission_timeout_s
        delay_s = _RETRY_FIRST_S
        # The plan's order, less workers that turned unroutable during the prefill (frozen,
        # suspected, draining); none left: a fresh ranking.
        workers = [w for w in candidates if w.routable]
        workers = workers or self.pool.ranked_decode(num_prompt_tokens)
        while True:
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
                        admitted = await self._admission(request, worker, prefill_worker, metadata)
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
            workers = self.pool.ranked_decode(num_prompt_tokens)

    async def _admission(
        self,
        request: decode_pb2.DecodeRequest,
        worker: Worker,
        prefill_worker: Worker,
        metadata: Metadata,
    ) -> tuple[grpc.aio.UnaryStreamCall, Worker, decode_pb2.Admitted] | None:
        """One decode worker's answer: admitted (its call, after the KV pull), None when it is
        full or turned the request away (try another), ``WorkerLost`` when the handle may be
        spent (re-prefill), else the client's error. Heartbeats come during the pull; each
        silence is bounded by ``stall_timeout_s``. A prefill worker that freezes during the
        pull (its stats stop answering: ``Worker.lost``) is given up on the same way: the
        decode worker's pull would otherwise wait for its own transfer timeout."""
        call = worker.decode_stub.Decode(request, metadata=metadata or None)
        worker.track(call)  # a relay: a certificate renewal must not cut it
        what = f"decode worker {worker.address}"
        try:
            while True:
                message = await self._read_unless_lost(call, worker, prefill_worker)
                if message == grpc.aio.EOF:
                    raise WorkerError(grpc.StatusCode.INTERNAL, "decode stream ended at once")
                assert isinstance(message, decode_pb2.DecodeResponse)
                if message.WhichOneof("event") == "admitted":
                    return call, worker, message.admitted
        except TimeoutError:
            call.cancel()
            raise stalled(worker, "admission silent for stall_timeout_s", Phase.ADMISSION) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            verdict = classify(Phase.ADMISSION, event(exc))
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
        self, call: grpc.aio.UnaryStreamCall, worker: Worker, prefill_worker: Worker
    ) -> object:
        """The call's next message; ``TimeoutError`` after ``stall_timeout_s`` of silence;
        ``WorkerLost`` (a stall) if the prefill worker or the decode worker ``worker`` turns
        lost meanwhile: heartbeats from a decode worker whose engine step hangs (its admission
        waits behind that step) prove nothing, as in ``relay``."""
        read = asyncio.ensure_future(call.read())
        watched = [asyncio.ensure_future(w.lost.wait()) for w in (prefill_worker, worker)]
        try:
            await asyncio.wait(
                {read, *watched},
                timeout=self.config.stall_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiting in watched:
                waiting.cancel()
            if not read.done():
                read.cancel()
        if read.done() and not read.cancelled():
            return read.result()
        if worker.lost.is_set():
            raise stalled(worker, "turned unhealthy during admission", Phase.ADMISSION)
        if prefill_worker.lost.is_set():
            raise stalled(prefill_worker, "stopped answering during the KV pull", Phase.ADMISSION)
        raise TimeoutError


class _Denied(Exception):
    """A decode worker refused the request's KV source (``pdserve/worker/peers.py``)."""
