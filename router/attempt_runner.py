"""One attempt at a request on the workers, as ``router/plan.py`` plans it: disaggregated
(prefill, first token, decode admission, then the decode stream) or on one decode worker alone
(conditional disaggregation, colocated), the relay of its tokens, and its typed events
(``router/attempt.py``). The request around its attempts (migration, quarantine, its final) is
``router/generation.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.common.convert import finish_reason_from_proto, logprobs_from_proto
from pdserve.v1 import decode_pb2, prefill_pb2
from router.attempt import (
    Attempt,
    AttemptEvent,
    CacheHits,
    Ended,
    Prefilled,
    Transferred,
    TurnedAway,
)
from router.config import RouterConfig
from router.dispatch import Dispatcher, Placement, prefill_request
from router.failures import Action, Phase, classify
from router.output_stream import OutputStream
from router.phases import RequestPhase
from router.plan import Pull, Route
from router.request_trace import RequestTrace
from router.worker import Worker
from router.worker_errors import event, failure, stalled
from router.worker_pool import WorkerPool


class AttemptRunner:
    def __init__(self, config: RouterConfig, pool: WorkerPool, dispatch: Dispatcher) -> None:
        self.config = config
        self.pool = pool
        self.dispatch = dispatch

    async def run(
        self, attempt: Attempt, out: OutputStream, trace: RequestTrace
    ) -> AsyncIterator[AttemptEvent]:
        """One try at the rest of the request, as ``router/plan.py`` plans it: on a decode worker
        alone (conditional disaggregation, colocated) or disaggregated; its last event is
        ``Ended``. A local worker that turns it away is excluded and the attempt re-planned
        (conditional: disaggregated; colocated: the next worker, UNAVAILABLE once every one
        has). Raises ``WorkerLost`` to migrate."""
        prompt_ids = attempt.continuation.prompt_token_ids
        needs_prefill = not self.config.colocated
        trace.enter(RequestPhase.ROUTE)
        if not self.pool.ready(needs_prefill):  # a worker may be back (or cleared) shortly
            await self.pool.wait_healthy(needs_prefill, timeout_s=self.config.stall_timeout_s)
        exclude: frozenset[str] = frozenset()
        local = True
        while True:
            if trace.clock.current is not RequestPhase.ROUTE:  # re-planned
                trace.enter(RequestPhase.ROUTE)
            placement = await self.dispatch.place(prompt_ids, attempt.avoid, exclude, local)
            route = placement.plan.route
            trace.routed(route, placement.plan.reason)
            if route is Route.DISAGGREGATED:
                async for event in self._disaggregated(attempt, placement, out, trace):
                    yield event
                return
            worker = placement.decode[0]
            try:
                pull = placement.plan.pull
                async for event in self._local(attempt, worker, route, out, trace, pull):
                    yield event
            except TurnedAway:
                exclude |= {worker.address}
                local = self.config.colocated  # conditional: disaggregate instead
                continue
            return

    async def _disaggregated(
        self, attempt: Attempt, placement: Placement, out: OutputStream, trace: RequestTrace
    ) -> AsyncIterator[AttemptEvent]:
        """Prefill on a prefill worker, stream its first token, then decode elsewhere."""
        start = time.perf_counter()
        trace.enter(RequestPhase.PREFILL_RPC, start)
        prompt_ids = attempt.continuation.prompt_token_ids
        num_generated = attempt.continuation.num_generated_tokens
        request = prefill_request(attempt.request_id, prompt_ids, num_generated, attempt.sampling)
        prefill_worker, prefilled = await self.dispatch.prefill(
            request, placement, trace.metadata()
        )
        cached = prefilled.num_cached_tokens if attempt.of_the_client_prompt else 0
        yield Prefilled(time.perf_counter() - start, cached)
        first_logprobs = (
            [logprobs_from_proto(prefilled.first_token_logprobs)]
            if prefilled.HasField("first_token_logprobs")
            else []
        )
        leased = prefilled.WhichOneof("outcome") == "lease"
        admitted = False
        try:
            prompt_logprobs = [logprobs_from_proto(lp) for lp in prefilled.prompt_logprobs]
            first = out.chunk([prefilled.first_token_id], first_logprobs, prompt_logprobs)
            then = RequestPhase.DECODE_ADMISSION if leased else RequestPhase.DECODE
            sent_s = out.last_token_s or time.perf_counter()
            trace.prefilled(
                sent_s, prefilled.queue_s, prefilled.compute_s, then, prefilled.peer_pull_phase_s
            )
            trace.count("host_cached_tokens", prefilled.num_host_cached_tokens)
            trace.count("pulled_tokens", prefilled.num_pulled_tokens)
            yield first
            if not leased:  # the first token ended it
                yield Ended(finish_reason_from_proto(prefilled.finished), Route.DISAGGREGATED)
                return
            decode_request = decode_pb2.DecodeRequest(
                request_id=attempt.request_id,
                prompt_token_ids=prompt_ids,
                sampling=attempt.sampling,
                first_token_id=prefilled.first_token_id,
                handle=prefilled.lease,
                prefill_address=prefill_worker.address,
                num_generated_tokens=num_generated,
            )
            if prefilled.HasField("first_token_logprobs"):
                decode_request.first_token_logprobs.CopyFrom(prefilled.first_token_logprobs)
            call, decode_worker, admission = await self.dispatch.admission.admit(
                decode_request, prefill_worker, placement.decode, attempt.avoid, trace.metadata()
            )
            admitted = True  # the decode worker now owns ending the lease
            trace.admitted(admission.kv_pull_s)
            yield Transferred(admission.transfer_s)
            async for event in self._relay(call, decode_worker, Route.DISAGGREGATED, out, trace):
                yield event
        finally:
            if leased and not admitted:
                token = prefilled.lease.lease_token
                self.dispatch.release_later(prefill_worker, attempt.request_id, token)

    async def _local(
        self,
        attempt: Attempt,
        worker: Worker,
        route: Route,
        out: OutputStream,
        trace: RequestTrace,
        pull: Pull | None = None,
    ) -> AsyncIterator[AttemptEvent]:
        """Conditional disaggregation (or colocated: ``route``): the decode worker prefills the
        prompt's uncached part, after pulling its prefix from ``pull``'s holder when the plan
        chose one. Raises ``TurnedAway`` (before any token) when it cannot take it now."""
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id=attempt.request_id,
            prompt_token_ids=attempt.continuation.prompt_token_ids,
            sampling=attempt.sampling,
            num_generated_tokens=attempt.continuation.num_generated_tokens,
            model_fingerprint=self.dispatch.cluster.fingerprint,
        )
        if pull is not None:
            request.prefix.CopyFrom(
                prefill_pb2.PrefixSource(holder_address=pull.holder, num_blocks=pull.num_blocks)
            )
        trace.enter(RequestPhase.LOCAL_PREFILL)
        call = worker.decode_stub.PrefillAndDecode(request, metadata=trace.metadata() or None)
        worker.track(call)  # a relay: a certificate renewal must not cut it
        # Counted in flight from the call on: a burst of short prompts spreads over workers.
        with self.pool.dispatched(worker):
            try:
                async with asyncio.timeout(self.config.stall_timeout_s):
                    await call.read()  # queued
            except TimeoutError:
                call.cancel()
                what = "not queued within stall_timeout_s"
                raise stalled(worker, what, Phase.LOCAL) from None
            except grpc.aio.AioRpcError as exc:
                verdict = classify(Phase.LOCAL, event(exc))
                if verdict.action is Action.NEXT:
                    raise TurnedAway from None  # draining or gone: re-planned without it
                raise failure(exc, worker, f"decode worker {worker.address}", verdict) from None
            except BaseException:
                call.cancel()
                raise
        async for update in self._relay(call, worker, route, out, trace, attempt):
            yield update

    async def _relay(
        self,
        call: grpc.aio.UnaryStreamCall,
        worker: Worker,
        route: Route,
        out: OutputStream,
        trace: RequestTrace,
        local: Attempt | None = None,
    ) -> AsyncIterator[AttemptEvent]:
        """Relays a worker's token stream to the client (heartbeats are not relayed), then
        ``Ended``. ``local``: the attempt the worker prefilled itself, whose cache hits count
        when they are of the client's prompt."""
        finish_reason: str | None = None
        hits = host_hits = 0
        async for message in self.dispatch.relay(call, worker):
            kind = message.WhichOneof("event")
            if kind == "tokens":
                tokens = message.tokens
                chunk = out.chunk(
                    list(tokens.token_ids),
                    [logprobs_from_proto(lp) for lp in tokens.logprobs],
                    [logprobs_from_proto(lp) for lp in tokens.prompt_logprobs],
                )
                if trace.clock.current is RequestPhase.LOCAL_PREFILL:  # its first token
                    trace.enter(RequestPhase.DECODE, out.last_token_s)
                yield chunk
                hits = max(hits, tokens.num_cached_tokens)
                host_hits = max(host_hits, tokens.num_host_cached_tokens)
            elif kind == "finished":
                finished = message.finished
                finish_reason = finish_reason_from_proto(finished.reason)
                trace.count("spec_proposed_tokens", finished.num_spec_proposed_tokens)
                trace.count("spec_accepted_tokens", finished.num_spec_accepted_tokens)
        trace.count("host_cached_tokens", host_hits)
        if local is not None and local.of_the_client_prompt:
            yield CacheHits(hits)
        yield Ended(finish_reason, route)
