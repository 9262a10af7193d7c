"""The public ``pdserve.v1.Router`` service: validate, prefill, hand over to decode, relay.

Lease ownership: see ``router/dispatch.py`` (the contract is in ``kvtransfer/base.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.fingerprint import fingerprint_of
from engine.model_config import ModelConfig
from engine.prompt import validate_prompt, validate_token_ids
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pdserve.common import metrics
from pdserve.common.convert import sampling_from_proto, sampling_to_proto
from pdserve.common.server import Service
from pdserve.v1 import common_pb2, decode_pb2, router_pb2, router_pb2_grpc
from router.cluster_state import ClusterState
from router.config import RouterConfig
from router.dispatch import Dispatcher, WorkerError, worker_error
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

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        start_s = time.perf_counter()
        if self.draining or self._pool is None:
            state = "draining" if self.draining else "still loading"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"router is {state}")
        client_id = request.request_id or uuid.uuid4().hex
        # Unique on the workers even if a client reuses its ids.
        request_id = f"{client_id}-{uuid.uuid4().hex[:8]}"
        try:
            prompt_ids, params = self._validate(request)
        except ValueError as exc:
            metrics.REQUEST_ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        out = OutputStream(
            self.tokenizer, prompt_ids, params, self.model_config.eos_token_ids, start_s
        )
        self._inflight += 1
        metrics.ROUTER_INFLIGHT.inc()
        try:
            async for response in self._generate(request_id, client_id, prompt_ids, params, out):
                yield response
        except WorkerError as exc:
            metrics.REQUEST_ERRORS.labels(exc.code.name).inc()
            logger.warning("request_id=%s failed: %s %s", request_id, exc.code.name, exc.message)
            await context.abort(exc.code, exc.message)
        finally:
            self._inflight -= 1
            metrics.ROUTER_INFLIGHT.dec()

    async def _generate(
        self,
        request_id: str,
        client_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        out: OutputStream,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        sampling = sampling_to_proto(params)
        done = _Outcome()
        local = await self.dispatch.choose_local(prompt_ids)
        tried: set[str] = set()
        while local is not None:
            done.fall_back = False
            async for response in self._local(request_id, prompt_ids, sampling, local, out, done):
                yield response
            if not (done.fall_back and self.config.colocated):
                break
            # Colocated has no prefill pool to fall back on: the next worker takes it (or the
            # choice raises UNAVAILABLE once every worker has turned it away).
            tried.add(local.address)
            local = await self.dispatch.choose_local(prompt_ids, frozenset(tried))
        if local is None or done.fall_back:
            local = None
            stream = self._disaggregated(request_id, prompt_ids, sampling, out, done)
            async for response in stream:
                yield response
        if done.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            raise WorkerError(grpc.StatusCode.INTERNAL, "decode stream ended without a finish")
        tail = out.tail()
        if tail:
            yield router_pb2.GenerateResponse(chunk=router_pb2.TokenChunk(text=tail))
        final = out.final(
            client_id, done.finish_reason, done.cached_tokens, done.prefill_s, done.transfer_s
        )
        metrics.TTFT_S.observe(out.ttft_s)
        metrics.TPOT_S.observe(out.mean_tpot_s)
        metrics.PREFIX_HIT_TOKENS.inc(done.cached_tokens)
        metrics.REQUESTS.labels(final.final.finish_reason).inc()
        logger.info(
            "request_id=%s finished (%s): %d+%d tokens, ttft %.1f ms, tpot %.2f ms",
            request_id,
            "local prefill" if local is not None else "disaggregated",
            out.num_prompt_tokens,
            out.num_output_tokens,
            out.ttft_s * 1e3,
            out.mean_tpot_s * 1e3,
        )
        yield final

    async def _disaggregated(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        out: OutputStream,
        done: _Outcome,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Prefill on a prefill worker, stream its first token, then decode elsewhere."""
        start = time.perf_counter()
        prefill_worker, prefilled = await self.dispatch.prefill(request_id, prompt_ids, sampling)
        done.prefill_s = time.perf_counter() - start
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
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling,
                first_token_id=prefilled.first_token_id,
                handle=prefilled.handle,
                prefill_address=prefill_worker.address,
            )
            if prefilled.HasField("first_token_logprobs"):
                decode_request.first_token_logprobs.CopyFrom(prefilled.first_token_logprobs)
            call, decode_worker, done.transfer_s = await self.dispatch.admit(
                decode_request, prefill_worker, len(prompt_ids)
            )
            admitted = True  # the decode worker now owns ending the lease
            async for response in self._relay(call, decode_worker, out, done):
                yield response
        finally:
            if leased and not admitted:
                self.dispatch.release_later(prefill_worker, request_id)

    async def _local(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        worker: Worker,
        out: OutputStream,
        done: _Outcome,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Conditional disaggregation: the decode worker prefills the short uncached part."""
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling
        )
        call = worker.decode.PrefillAndDecode(request)
        try:
            await call.read()  # admitted
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                done.fall_back = True  # draining or gone: disaggregate instead
                return
            raise worker_error(exc, f"decode worker {worker.address}") from None
        except BaseException:
            call.cancel()
            raise
        async for response in self._relay(call, worker, out, done):
            yield response

    async def _relay(
        self,
        call: grpc.aio.UnaryStreamCall,
        worker: Worker,
        out: OutputStream,
        done: _Outcome,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Relays a decode worker's token stream to the client."""
        with self.pool.dispatched(worker):
            try:
                while (message := await call.read()) != grpc.aio.EOF:
                    assert isinstance(message, decode_pb2.DecodeResponse)
                    if message.token_ids:
                        yield out.chunk(list(message.token_ids), list(message.logprobs))
                    done.cached_tokens = max(done.cached_tokens, message.num_cached_tokens)
                    done.finish_reason = message.finish_reason
            except grpc.aio.AioRpcError as exc:
                raise worker_error(exc, f"decode worker {worker.address}") from None
            finally:
                call.cancel()  # client gone: stop the decode worker's request too


@dataclass
class _Outcome:
    """What a request's path reports for its final message."""

    finish_reason: common_pb2.FinishReason.ValueType = common_pb2.FINISH_REASON_UNSPECIFIED
    cached_tokens: int = 0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    fall_back: bool = False  # the local-prefill worker was unavailable: disaggregate
