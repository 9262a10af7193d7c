"""One request's path through the workers, as the client sees it: its attempts (each one run by
``router/attempt_runner.py``), migration to another worker when one fails mid-flight (the rule:
``router/migration.py``), quarantine, and its final result.

Shared by every public frontend (gRPC ``Router.Generate``, the OpenAI HTTP API): they validate,
then iterate ``Generation.generate``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc

from pdserve.common import metrics
from pdserve.common.convert import sampling_to_proto
from router.attempt import Attempt, Ended, Report
from router.attempt_runner import AttemptRunner
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.failures import Action
from router.migration import Finished, attempt_id, continue_request
from router.output_stream import OutputStream
from router.phases import RequestPhase
from router.quarantine import POISON_STRIKES, Quarantine, request_digest
from router.request import Request
from router.request_trace import RequestTrace
from router.result import Chunk, Final, Result
from router.worker_errors import WorkerError, WorkerLost
from router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


@dataclass
class _Tries:
    """A request's attempts so far: their facts, the workers it failed on, its migrations."""

    report: Report = field(default_factory=Report)
    avoid: set[str] = field(default_factory=set)
    migrations: int = 0


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
        self.attempts = AttemptRunner(config, pool, dispatch)

    async def generate(
        self,
        request_id: str,
        request: Request,
        out: OutputStream,
        queued: tuple[float, float] | None = None,
    ) -> AsyncGenerator[Result, None]:
        """One request, validated, as the client sees it: token chunks, then the final result.
        A worker that fails mid-flight is replaced (``router/migration.py``) up to
        ``migration_limit`` times, invisibly to the client; a request that keeps losing
        workers (or that a worker's last words name as its killer) is quarantined
        (``router/quarantine.py``: its caller's, with this prompt and sampling). Its phases and
        trace: ``router/request_trace.py``; ``queued``: when it waited in flow control's
        queues. Raises ``WorkerError``."""
        trace = RequestTrace(request_id, out.start_s)
        if queued is not None:  # its wait in flow control's queues (``queued``: from, to)
            trace.enter(RequestPhase.FLOW_QUEUE, queued[0])
            trace.enter(RequestPhase.ROUTER, queued[1])
        digest = request_digest(request.caller, request.prompt_token_ids, request.params)
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
        tries = _Tries()
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
                tries.report = tries.report.add(Ended(step.reason))
                break
            attempt_name = attempt_id(request_id, tries.migrations)
            attempt = Attempt(attempt_name, step, sampling, frozenset(tries.avoid))
            try:
                async for event in self.attempts.run(attempt, out, trace):
                    if isinstance(event, Chunk):
                        yield event
                    else:
                        tries.report = tries.report.add(event)
                break
            except WorkerLost as exc:
                await self._migrate(request_id, digest, exc, tries, out, trace)
        if tries.report.finish_reason is None:
            raise WorkerError(grpc.StatusCode.INTERNAL, "decode stream ended without a finish")
        tail = out.tail()
        if tail:
            yield Chunk([], tail)
        yield self._final(request_id, request.client_id, tries, out, trace)

    async def _migrate(
        self,
        request_id: str,
        digest: str,
        exc: WorkerLost,
        tries: _Tries,
        out: OutputStream,
        trace: RequestTrace,
    ) -> None:
        """An attempt lost its worker: the request goes on with the next one (after a healthy
        pool), unless the failure table condemns it, its strikes or ``migration_limit`` end it
        (``WorkerError``)."""
        verdict = exc.verdict
        if verdict.action is Action.QUARANTINE:
            self._condemn(request_id, digest, exc)
        if verdict.strike:
            self._strike(request_id, digest, exc)
        if tries.migrations >= self.config.migration_limit:
            raise WorkerError(
                exc.code,
                f"{exc.message} (after {tries.migrations} migrations: migration_limit)",
            ) from None
        tries.migrations += 1
        trace.failed(verdict.reason, exc.message)
        trace.enter(RequestPhase.MIGRATION, reason=verdict.reason)
        tries.avoid.update(exc.avoid)
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

    def _final(
        self, request_id: str, client_id: str, tries: _Tries, out: OutputStream, trace: RequestTrace
    ) -> Final:
        """The request's final result, its trace ended, its metrics and log line written."""
        report, migrations = tries.report, tries.migrations
        assert report.finish_reason is not None
        trace.finish(
            {
                "pdserve.ttft_s": out.ttft_s,
                "pdserve.prompt_tokens": out.num_prompt_tokens,
                "pdserve.output_tokens": out.num_output_tokens,
                "pdserve.migrations": migrations,
            }
        )
        final = out.final(
            client_id,
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
        return final

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
