"""One request's path through the workers, as the client sees it: conditional disaggregation
or disaggregated (prefill, first token, decode), the relay of tokens, and migration to another
worker when one fails mid-flight (the rule: ``router/migration.py``).

Shared by every public frontend (gRPC ``Router.Generate``, the OpenAI HTTP API): they validate,
then iterate ``Generation.generate``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from pdserve.common import metrics
from pdserve.common.convert import finish_reason_from_proto, logprobs_from_proto, sampling_to_proto
from pdserve.v1 import decode_pb2
from router.attempt import (
    Attempt,
    AttemptEvent,
    CacheHits,
    Ended,
    Prefilled,
    Report,
    Transferred,
    TurnedAway,
)
from router.config import RouterConfig
from router.dispatch import Dispatcher, Placement, prefill_request
from router.failures import Action, Phase, classify
from router.migration import Finished, attempt_id, continue_request
from router.output_stream import OutputStream
from router.phases import RequestPhase
from router.plan import Route
from router.quarantine import POISON_STRIKES, Quarantine, request_digest
from router.request import Request
from router.request_trace import RequestTrace
from router.result import Chunk, Result
from router.worker_errors import WorkerError, WorkerLost, event, failure, stalled
from router.worker_pool import Worker, WorkerPool

logger = logging.getLogger(__name__)


class Generation:
    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        dispatch: Dispatcher,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.config = config
        self.pool = pool
        self.dispatch = dispatch
        self.eos_token_ids = eos_token_ids
        self.quarantine = Quarantine(config.quarantine_s)

    async def generate(
        self, request_id: str, request: Request, out: OutputStream
    ) -> AsyncGenerator[Result, None]:
        """One request, validated, as the client sees it: token chunks, then the final result.
        A worker that fails mid-flight is replaced (``router/migration.py``) up to
        ``migration_limit`` times, invisibly to the client; a request that keeps losing
        workers (or that a worker's last words name as its killer) is quarantined
        (``router/quarantine.py``: its caller's, with this prompt and sampling). Its phases and
        trace: ``router/request_trace.py``. Raises ``WorkerError``."""
        trace = RequestTrace(request_id, out.start_s)
        digest = request_digest(request.caller, list(request.prompt_token_ids), request.params)
        try:
            async for result in self._generate(request_id, request, digest, out, trace):
                yield result
        finally:
            trace.finish()  # a no-op after the final message; else an error or the client gone

    async def _generate(
        self, request_id: str, request: Request, digest: str, out: OutputStream, trace: RequestTrace
    ) -> AsyncGenerator[Result, None]:
        if self.quarantine.quarantined(digest):
            metrics.QUARANTINED.labels("refused").inc()
            raise WorkerError(
                grpc.StatusCode.INTERNAL,
                "request quarantined: workers died running this prompt with these sampling "
                f"parameters; refused for quarantine_s={self.config.quarantine_s:g}",
            )
        prompt_ids, params = list(request.prompt_token_ids), request.params
        sampling = sampling_to_proto(params)  # the worker calls', once
        report = Report()
        avoid: set[str] = set()  # workers this request failed on
        migrations = 0
        while True:
            step = continue_request(
                prompt_ids,
                out.output_token_ids,
                params,
                self.eos_token_ids,
                self.pool.max_model_len or len(prompt_ids) + params.max_tokens,
                out.stopped,
            )
            if isinstance(step, Finished):  # what the client has already ends the request
                report = report.add(Ended(step.reason))
                break
            attempt = Attempt(attempt_id(request_id, migrations), step, sampling, frozenset(avoid))
            try:
                async for event in self._attempt(attempt, out, trace):
                    if isinstance(event, Chunk):
                        yield event
                    else:
                        report = report.add(event)
                break
            except WorkerLost as exc:
                verdict = exc.verdict
                if verdict.action is Action.QUARANTINE:
                    self._condemn(request_id, digest, exc)
                if verdict.strike:
                    self._strike(request_id, digest, exc)
                if migrations >= self.config.migration_limit:
                    raise WorkerError(
                        exc.code,
                        f"{exc.message} (after {migrations} migrations: migration_limit)",
                    ) from None
                migrations += 1
                trace.failed(verdict.reason, exc.message)
                trace.enter(RequestPhase.MIGRATION, reason=verdict.reason)
                avoid.update(exc.avoid)
                if verdict.suspect:
                    self.pool.suspect(exc.address, f"{verdict.reason}: {exc.message}")
                out.migrating()
                metrics.MIGRATIONS.labels(verdict.reason).inc()
                logger.warning(
                    "request_id=%s migrating after %d tokens (%s): %s",
                    request_id,
                    out.num_output_tokens,
                    verdict.reason,
                    exc.message,
                )
                await self.pool.wait_healthy(
                    needs_prefill=not self.config.colocated, timeout_s=self.config.stall_timeout_s
                )
        if report.finish_reason is None:
            raise WorkerError(grpc.StatusCode.INTERNAL, "decode stream ended without a finish")
        tail = out.tail()
        if tail:
            yield Chunk([], tail)
        trace.finish(
            {
                "pdserve.ttft_s": out.ttft_s,
                "pdserve.prompt_tokens": out.num_prompt_tokens,
                "pdserve.output_tokens": out.num_output_tokens,
                "pdserve.migrations": migrations,
            }
        )
        final = out.final(
            request.client_id,
            report.finish_reason,
            report.cached_tokens,
            report.prefill_s,
            report.transfer_s,
            migrations,
            trace.breakdown(),
        )
        metrics.TTFT_S.observe(out.ttft_s)
        metrics.TPOT_S.observe(out.mean_tpot_s)
        metrics.PROMPT_TOKENS.observe(out.num_prompt_tokens)
        metrics.OUTPUT_TOKENS.observe(out.num_output_tokens)
        metrics.PREFIX_HIT_TOKENS.inc(report.cached_tokens)
        metrics.REQUESTS.labels(final.finish_reason).inc()
        logger.info(
            "request_id=%s finished (%s%s): %d+%d tokens, ttft %.1f ms, tpot %.2f ms",
            request_id,
            report.route.value if report.route is not None else "no route",
            f", {migrations} migrations" if migrations else "",
            out.num_prompt_tokens,
            out.num_output_tokens,
            out.ttft_s * 1e3,
            out.mean_tpot_s * 1e3,
        )
        yield final

    def _strike(self, request_id: str, digest: str, exc: WorkerLost) -> None:
        """A worker went away running the request, which may have caused it: a strike
        against the request; the last one ends it (it would go on taking workers down)."""
        strikes = self.quarantine.strike(digest, exc.address)
        logger.warning(
            "request_id=%s: %s went away running it (strike %d of %d)",
            request_id,
            exc.address,
            strikes,
            POISON_STRIKES,
        )
        if strikes >= POISON_STRIKES:
            metrics.QUARANTINED.labels("ended").inc()
            raise WorkerError(
                grpc.StatusCode.INTERNAL,
                f"request quarantined: {strikes} workers went away running it, the last "
                f"{exc.address} ({exc.message})",
            ) from None

    def _condemn(self, request_id: str, digest: str, exc: WorkerLost) -> None:
        """The dead worker's last words say this request killed it (alone in the failed
        step): it ends here, and no other worker is risked on it."""
        self.quarantine.condemn(digest, exc.address)
        metrics.QUARANTINED.labels("ended").inc()
        logger.error("request_id=%s: %s's engine died stepping it alone", request_id, exc.address)
        raise WorkerError(
            grpc.StatusCode.INTERNAL,
            f"request quarantined: the engine of {exc.address} failed stepping it alone "
            f"({exc.message}); refused for quarantine_s={self.config.quarantine_s:g}",
        ) from None

    async def _attempt(
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
            trace.routed(route)
            if route is Route.DISAGGREGATED:
                async for event in self._disaggregated(attempt, placement, out, trace):
                    yield event
                return
            worker = placement.decode[0]
            try:
                async for event in self._local(attempt, worker, route, out, trace):
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
            trace.prefilled(sent_s, prefilled.queue_s, prefilled.compute_s, then)
            trace.count("host_cached_tokens", prefilled.num_host_cached_tokens)
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
            call, decode_worker, admission = await self.dispatch.admit(
                decode_request, prefill_worker, placement, attempt.avoid, trace.metadata()
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
    ) -> AsyncIterator[AttemptEvent]:
        """Conditional disaggregation (or colocated: ``route``): the decode worker prefills the
        prompt's uncached part. Raises ``TurnedAway`` (before any token) when it cannot take it
        now."""
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id=attempt.request_id,
            prompt_token_ids=attempt.continuation.prompt_token_ids,
            sampling=attempt.sampling,
            num_generated_tokens=attempt.continuation.num_generated_tokens,
            model_fingerprint=self.dispatch.cluster.fingerprint,
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
