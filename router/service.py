"""The public ``pdserve.v1.Router`` service: validate, prefill, hand over to decode, relay,
and migrate a stream whose worker fails (``router/migration.py``).

Lease ownership: see ``router/dispatch.py`` (the contract is in ``kvtransfer/base.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc

from engine.fingerprint import fingerprint_of
from engine.model_config import ModelConfig
from engine.prompt import validate_prompt, validate_token_ids
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pdserve.common import metrics
from pdserve.common.convert import finish_reason_to_proto, sampling_from_proto, sampling_to_proto
from pdserve.common.server import Service
from pdserve.v1 import common_pb2, decode_pb2, router_pb2, router_pb2_grpc
from router.cluster_state import ClusterState
from router.config import RouterConfig
from router.dispatch import Dispatcher, WorkerError, WorkerLost, prefill_request, worker_error
from router.migration import Continuation, attempt_id, continue_request
from router.output_stream import OutputStream
from router.worker_pool import Worker, WorkerPool

logger = logging.getLogger(__name__)


class RouterService(Service, router_pb2_grpc.RouterServicer):
    name = "pdserve.v1.Router"

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self._pool: WorkerPool | None = None
        self._cluster: ClusterState | None = None
        self._dispatch: Dispatcher | None = None
        self._inflight = 0

    def register(self, server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(self, server)

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            raise RuntimeError("the router is not loaded yet")
        return self._pool

    @property
    def dispatch(self) -> Dispatcher:
        if self._dispatch is None:
            raise RuntimeError("the router is not loaded yet")
        return self._dispatch

    async def load(self) -> None:
        config = self.config
        # Channels belong to the running event loop, so the pool is built here.
        self._pool = WorkerPool(
            config.prefill_addresses,
            config.decode_addresses,
            config.prefill_policy,
            config.decode_policy,
        )
        fingerprint = await asyncio.to_thread(
            fingerprint_of, config.model, config.dtype, config.block_size
        )
        self._cluster = ClusterState(config.redis, self._pool, fingerprint, config.block_size)
        self._dispatch = Dispatcher(config, self._pool, self._cluster)
        await self._cluster.wait_ready(config.ready_timeout_s, needs_prefill=not config.colocated)
        self._cluster.start(config.stats_interval_s)

    def num_inflight(self) -> int:
        return self._inflight

    async def close(self) -> None:
        if self._cluster is not None:
            await self._cluster.close()
        if self._dispatch is not None:
            await self._dispatch.close()
        if self._pool is not None:
            await self._pool.close()

    def _validate(self, request: router_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        has_text, has_ids = request.HasField("prompt"), len(request.prompt_token_ids) > 0
        if has_text == has_ids:
            raise ValueError("set exactly one of prompt and prompt_token_ids")
        params = sampling_from_proto(request.sampling)
        vocab_size = self.model_config.vocab_size
        validate_token_ids(list(params.stop_ids), vocab_size, "stop_token_ids")
        prompt = request.prompt if has_text else list(request.prompt_token_ids)
        prompt_ids = validate_prompt(prompt, self.tokenizer, vocab_size, self.pool.max_model_len)
        return prompt_ids, params

    def check_capacity(self, num_prompt_tokens: int) -> None:
        """A prompt no worker of a needed pool could ever hold is refused before any work."""
        pools = [("decode", self.pool.decode)]
        if not self.config.colocated:
            pools.append(("prefill", self.pool.prefill))
        for name, workers in pools:
            sizes = [w.load() for w in workers.values() if w.stats is not None and w.healthy]
            if not sizes:
                continue  # nothing known yet: the workers themselves refuse it
            best = max(sizes, key=lambda w: w.num_blocks)
            if best.blocks_for(num_prompt_tokens) > best.num_blocks:
                raise ResourceError(
                    f"no {name} worker can hold {num_prompt_tokens} prompt tokens: the largest "
                    f"holds {best.num_blocks * best.block_size} tokens of KV cache"
                )

    async def Generate(  # type: ignore[override]  # a writer, not a generator: see below
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """A server stream written with ``context.write`` (not yielded): each write is bounded
        by ``client_idle_timeout_s``, so a client that stops reading is cancelled, and what it
        held on the workers freed, instead of pinning them forever."""
        start_s = time.perf_counter()
        if self.draining or self._pool is None:
            state = "draining" if self.draining else "still loading"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"router is {state}")
        client_id = request.request_id or uuid.uuid4().hex
        # Unique on the workers even if a client reuses its ids.
        request_id = f"{client_id}-{uuid.uuid4().hex[:8]}"
        try:
            prompt_ids, params = self._validate(request)
            self.check_capacity(len(prompt_ids))
        except ResourceError as exc:
            metrics.REQUEST_ERRORS.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            metrics.REQUEST_ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        out = OutputStream(
            self.tokenizer, prompt_ids, params, self.model_config.eos_token_ids, start_s
        )
        self._inflight += 1
        metrics.ROUTER_INFLIGHT.inc()
        stream = self.generate(request_id, client_id, prompt_ids, params, out)
        try:
            async with contextlib.aclosing(stream):
                async for response in stream:
                    async with asyncio.timeout(self.config.client_idle_timeout_s):
                        await context.write(response)
        except TimeoutError:
            metrics.CLIENT_IDLE_CANCELS.inc()
            logger.warning(
                "request_id=%s cancelled: the client read nothing for %.0f s",
                request_id,
                self.config.client_idle_timeout_s,
            )
            await context.abort(
                grpc.StatusCode.CANCELLED,
                f"the client read nothing for client_idle_timeout_s="
                f"{self.config.client_idle_timeout_s}",
            )
        except WorkerError as exc:
            metrics.REQUEST_ERRORS.labels(exc.code.name).inc()
            logger.warning("request_id=%s failed: %s %s", request_id, exc.code.name, exc.message)
            await context.abort(exc.code, exc.message)
        finally:
            self._inflight -= 1
            metrics.ROUTER_INFLIGHT.dec()

    async def generate(
        self,
        request_id: str,
        client_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        out: OutputStream,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """One request, validated, as the client sees it: token chunks, then the final message.
        A worker that fails mid-flight is replaced (``router/migration.py``) up to
        ``migration_limit`` times, invisibly to the client. Raises ``WorkerError``."""
        sampling = sampling_to_proto(params)
        done = _Outcome()
        avoid: set[str] = set()  # workers this request failed on
        migrations = 0
        local: Worker | None = None
        while True:
            step = continue_request(
                prompt_ids,
                out.output_token_ids,
                params,
                self.model_config.eos_token_ids,
                self.pool.max_model_len or len(prompt_ids) + params.max_tokens,
                out.stopped,
            )
            if isinstance(step, str):  # what the client has already ends the request
                done.finish_reason = finish_reason_to_proto(step)
                break
            attempt = _Attempt(attempt_id(request_id, migrations), step, sampling, frozenset(avoid))
            try:
                async for response in self._attempt(attempt, out, done):
                    yield response
                local = done.local
                break
            except WorkerLost as exc:
                if migrations >= self.config.migration_limit:
                    raise WorkerError(
                        exc.code,
                        f"{exc.message} (after {migrations} migrations: migration_limit)",
                    ) from None
                migrations += 1
                avoid.add(exc.address)
                if exc.reason in ("stall", "unavailable"):  # that worker, not its peer's KV
                    self.pool.suspect(exc.address, f"{exc.reason}: {exc.message}")
                out.migrating()
                metrics.MIGRATIONS.labels(exc.reason).inc()
                logger.warning(
                    "request_id=%s migrating after %d tokens (%s): %s",
                    request_id,
                    out.num_output_tokens,
                    exc.reason,
                    exc.message,
                )
                await self.pool.wait_healthy(
                    needs_prefill=not self.config.colocated, timeout_s=self.config.stall_timeout_s
                )
        if done.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            raise WorkerError(grpc.StatusCode.INTERNAL, "decode stream ended without a finish")
        tail = out.tail()
        if tail:
            yield router_pb2.GenerateResponse(chunk=router_pb2.TokenChunk(text=tail))
        final = out.final(
            client_id,
            done.finish_reason,
            done.cached_tokens,
            done.prefill_s,
            done.transfer_s,
            migrations,
        )
        metrics.TTFT_S.observe(out.ttft_s)
        metrics.TPOT_S.observe(out.mean_tpot_s)
        metrics.PREFIX_HIT_TOKENS.inc(done.cached_tokens)
        metrics.REQUESTS.labels(final.final.finish_reason).inc()
        logger.info(
            "request_id=%s finished (%s%s): %d+%d tokens, ttft %.1f ms, tpot %.2f ms",
            request_id,
            "local prefill" if local is not None else "disaggregated",
            f", {migrations} migrations" if migrations else "",
            out.num_prompt_tokens,
            out.num_output_tokens,
            out.ttft_s * 1e3,
            out.mean_tpot_s * 1e3,
        )
        yield final

    async def _attempt(
        self, attempt: _Attempt, out: OutputStream, done: _Outcome
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """One try at the rest of the request: on a decode worker alone (conditional
        disaggregation, colocated) or disaggregated. Raises ``WorkerLost`` to migrate."""
        prompt_ids = attempt.continuation.prompt_token_ids
        tried = set(attempt.avoid) if self.config.colocated else set()
        local = await self.dispatch.choose_local(prompt_ids, frozenset(tried))
        while local is not None:
            done.fall_back = False
            async for response in self._local(attempt, local, out, done):
                yield response
            if not (done.fall_back and self.config.colocated):
                break
            # Colocated has no prefill pool to fall back on: the next worker takes it (or the
            # choice raises UNAVAILABLE once every worker has turned it away).
            tried.add(local.address)
            local = await self.dispatch.choose_local(prompt_ids, frozenset(tried))
        if local is None or done.fall_back:
            done.local = None
            async for response in self._disaggregated(attempt, out, done):
                yield response
        else:
            done.local = local

    async def _disaggregated(
        self, attempt: _Attempt, out: OutputStream, done: _Outcome
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Prefill on a prefill worker, stream its first token, then decode elsewhere."""
        start = time.perf_counter()
        prompt_ids = attempt.continuation.prompt_token_ids
        num_generated = attempt.continuation.num_generated_tokens
        request = prefill_request(attempt.request_id, prompt_ids, num_generated, attempt.sampling)
        prefill_worker, prefilled = await self.dispatch.prefill(request, attempt.avoid)
        done.prefill_s += time.perf_counter() - start
        if not num_generated:  # cache hits of the client's prompt, not of a continuation
            done.cached_tokens = prefilled.num_cached_tokens
        done.finish_reason = prefilled.finish_reason
        first_logprobs = (
            [prefilled.first_token_logprobs] if prefilled.HasField("first_token_logprobs") else []
        )
        leased = done.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        admitted = False
        try:
            yield out.chunk([prefilled.first_token_id], first_logprobs)
            if not leased:
                return
            decode_request = decode_pb2.DecodeRequest(
                request_id=attempt.request_id,
                prompt_token_ids=prompt_ids,
                sampling=attempt.sampling,
                first_token_id=prefilled.first_token_id,
                handle=prefilled.handle,
                prefill_address=prefill_worker.address,
                num_generated_tokens=num_generated,
            )
            if prefilled.HasField("first_token_logprobs"):
                decode_request.first_token_logprobs.CopyFrom(prefilled.first_token_logprobs)
            call, decode_worker, transfer_s = await self.dispatch.admit(
                decode_request, prefill_worker, attempt.avoid
            )
            done.transfer_s += transfer_s
            admitted = True  # the decode worker now owns ending the lease
            async for response in self._relay(call, decode_worker, out, done, False):
                yield response
        finally:
            if leased and not admitted:
                self.dispatch.release_later(prefill_worker, attempt.request_id)

    async def _local(
        self, attempt: _Attempt, worker: Worker, out: OutputStream, done: _Outcome
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Conditional disaggregation: the decode worker prefills the short uncached part."""
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id=attempt.request_id,
            prompt_token_ids=attempt.continuation.prompt_token_ids,
            sampling=attempt.sampling,
            num_generated_tokens=attempt.continuation.num_generated_tokens,
        )
        call = worker.decode.PrefillAndDecode(request)
        try:
            async with asyncio.timeout(self.config.stall_timeout_s):
                await call.read()  # admitted
        except TimeoutError:
            call.cancel()
            raise WorkerLost(
                grpc.StatusCode.UNAVAILABLE,
                f"decode worker {worker.address}: no admission within stall_timeout_s",
                "stall",
                worker.address,
            ) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                done.fall_back = True  # draining or gone: disaggregate instead
                return
            raise worker_error(exc, f"decode worker {worker.address}") from None
        except BaseException:
            call.cancel()
            raise
        count_cached = attempt.continuation.num_generated_tokens == 0
        async for response in self._relay(call, worker, out, done, count_cached):
            yield response

    async def _relay(
        self,
        call: grpc.aio.UnaryStreamCall,
        worker: Worker,
        out: OutputStream,
        done: _Outcome,
        count_cached: bool,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Relays a worker's token stream to the client (heartbeats are not relayed).
        ``count_cached``: its cache hits are of the client's prompt (not a continuation)."""
        async for message in self.dispatch.relay(call, worker):
            if message.token_ids:
                yield out.chunk(list(message.token_ids), list(message.logprobs))
            if count_cached:
                done.cached_tokens = max(done.cached_tokens, message.num_cached_tokens)
            done.finish_reason = message.finish_reason


class ResourceError(ValueError):
    """No worker could ever serve the request (RESOURCE_EXHAUSTED, not INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class _Attempt:
    """One try at a request: its id on the workers, what it asks for, whom to avoid."""

    request_id: str
    continuation: Continuation
    sampling: common_pb2.SamplingParams
    avoid: frozenset[str]


@dataclass
class _Outcome:
    """What a request's path reports for its final message."""

    finish_reason: common_pb2.FinishReason.ValueType = common_pb2.FINISH_REASON_UNSPECIFIED
    cached_tokens: int = 0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    fall_back: bool = False  # the local-prefill worker was unavailable: disaggregate
    local: Worker | None = None  # the worker that prefilled locally, if any
