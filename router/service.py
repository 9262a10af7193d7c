"""The public ``pdserve.v1.Router`` service: the gRPC frontend of the router.

It authenticates (API keys, when configured), refuses bad input before any work (sizes and
counts first: ``router/limits.py``; tokenization off the event loop: ``router/prompts.py``),
then streams ``router/generation.py``'s responses to the client, each write bounded by the
client idle timeout.

Lease ownership: see ``router/dispatch.py`` (the contract is in ``kvtransfer/base.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from engine.checkpoint import CheckpointInfo
from engine.fingerprint import engine_fingerprint
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pdserve.common import metrics
from pdserve.common.auth import ApiKeys, bearer
from pdserve.common.server import Service
from pdserve.v1 import router_pb2
from router.cluster_state import ClusterState
from router.config import RouterConfig
from router.dispatch import Dispatcher, WorkerError
from router.generation import Generation
from router.limits import invalid_utf8_field
from router.output_stream import OutputStream
from router.prompts import Overloaded, PromptReader
from router.worker_pool import WorkerPool

if TYPE_CHECKING:
    from router.openai.server import HttpServer

logger = logging.getLogger(__name__)

_PARSE_IN_THREAD_BYTES = 64 << 10


@dataclass(frozen=True)
class Unparsable:
    """A request body protobuf could not parse; ``Generate`` refuses it by name."""

    message: str


def parse_request(data: bytes) -> router_pb2.GenerateRequest | Unparsable:
    """The request deserializer: a body that does not parse becomes a named INVALID_ARGUMENT
    (gRPC's own answer would be UNKNOWN)."""
    try:
        return router_pb2.GenerateRequest.FromString(data)
    except Exception:  # protobuf's DecodeError, or worse: nothing of it may escape
        field = invalid_utf8_field(data)
        if field is not None:
            return Unparsable(f"{field} is not valid UTF-8")
        return Unparsable("the request is not a valid pdserve.v1.GenerateRequest")


class ResourceError(ValueError):
    """No worker could ever serve the request (RESOURCE_EXHAUSTED, not INVALID_ARGUMENT)."""


class RouterService(Service):
    name = "pdserve.v1.Router"
    public = True  # TLS without client certificates: API keys authenticate clients

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.checkpoint = CheckpointInfo.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.api_keys = ApiKeys(config.api_key_file) if config.api_key_file else None
        self.max_request_bytes = config.limits.max_request_bytes
        self.prompts = PromptReader(self.tokenizer, self.checkpoint.vocab_size, config.limits)
        self._pool: WorkerPool | None = None
        self._cluster: ClusterState | None = None
        self._generation: Generation | None = None
        self._inflight = 0
        self._http: HttpServer | None = None

    def register(self, server: grpc.aio.Server) -> None:
        # Raw bytes in: the body is parsed only once the caller proved its key.
        handler = grpc.unary_stream_rpc_method_handler(
            self.Generate,
            request_deserializer=None,
            response_serializer=router_pb2.GenerateResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(self.name, {"Generate": handler}),)
        )

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            raise RuntimeError("the router is not loaded yet")
        return self._pool

    @property
    def generation(self) -> Generation:
        if self._generation is None:
            raise RuntimeError("the router is not loaded yet")
        return self._generation

    @property
    def dispatch(self) -> Dispatcher:
        return self.generation.dispatch

    async def open(self) -> dict[str, str]:
        """The OpenAI HTTP API, when ``http_port`` is set (router/openai)."""
        if self.config.http_port is None:
            return {}
        # Imported here: FastAPI and uvicorn load only in routers that serve HTTP.
        from router.openai.app import build_app
        from router.openai.server import HttpServer

        server = self.config.server
        app = build_app(self, self.config.model_name)
        self._http = HttpServer(app, server.host, self.config.http_port, server.tls)
        return {"http": await self._http.start()}

    async def load(self) -> None:
        config = self.config
        # Channels belong to the running event loop, so the pool is built here.
        self._pool = WorkerPool(
            config.prefill_addresses,
            config.decode_addresses,
            config.prefill_policy,
            config.decode_policy,
            tls=config.server.tls,
        )
        fingerprint = await asyncio.to_thread(
            engine_fingerprint,
            config.model,
            config.engine,
            config.dtype,
            config.block_size,
            config.kv_cache_dtype,
        )
        self._cluster = ClusterState(config.redis, self._pool, fingerprint, config.block_size)
        dispatch = Dispatcher(config, self._pool, self._cluster)
        self._generation = Generation(config, self._pool, dispatch, self.checkpoint.eos_token_ids)
        await self._cluster.wait_ready(config.ready_timeout_s, needs_prefill=not config.colocated)
        self._cluster.start(config.stats_interval_s)

    def num_inflight(self) -> int:
        return self._inflight

    async def close(self) -> None:
        if self._http is not None:
            await self._http.stop()
        if self._cluster is not None:
            await self._cluster.close()
        if self._generation is not None:
            await self._generation.dispatch.close()
        if self._pool is not None:
            await self._pool.close()

    def authorized(self, authorization: str | None) -> bool:
        if self.api_keys is None or self.api_keys.allows(authorization):
            return True
        metrics.AUTH_FAILURES.inc()
        return False

    @property
    def max_model_len(self) -> int:
        """The workers' limit; the model's own until a worker reported one (a bound on what a
        request may carry even then)."""
        return self.pool.max_model_len or self.checkpoint.max_position_embeddings

    async def read(
        self, request: router_pb2.GenerateRequest, add_special_tokens: bool = True
    ) -> tuple[list[int], SamplingParams]:
        """The request's validated prompt ids and sampling. Raises ValueError
        (INVALID_ARGUMENT), ``ResourceError`` or ``Overloaded`` (RESOURCE_EXHAUSTED)."""
        prompt_ids, params = await self.prompts.read(
            request, self.max_model_len, add_special_tokens
        )
        self.check_capacity(len(prompt_ids))
        return prompt_ids, params

    def track(self) -> InFlight:
        """One public request, counted in flight from its admission to its last byte (drain
        waits for it). Every frontend takes one per request and ends it exactly once."""
        self._inflight += 1
        metrics.ROUTER_INFLIGHT.inc()
        metrics.ROUTER_ARRIVALS.inc()
        return InFlight(self)

    def _ended(self) -> None:
        self._inflight -= 1
        metrics.ROUTER_INFLIGHT.dec()

    async def responses(
        self, client_id: str, prompt_ids: list[int], params: SamplingParams, start_s: float
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """One validated request's stream under a request id unique on the workers even if
        clients reuse theirs. Every frontend's (inside its ``track``)."""
        request_id = f"{client_id}-{uuid.uuid4().hex[:8]}"
        out = OutputStream(
            self.tokenizer, prompt_ids, params, self.checkpoint.eos_token_ids, start_s
        )
        try:
            stream = self.generation.generate(request_id, client_id, prompt_ids, params, out)
            async with contextlib.aclosing(stream):
                async for response in stream:
                    yield response
        except WorkerError as exc:
            metrics.REQUEST_ERRORS.labels(exc.code.name).inc()
            logger.warning("request_id=%s failed: %s %s", request_id, exc.code.name, exc.message)
            raise

    def check_capacity(self, num_prompt_tokens: int) -> None:
        """A prompt no worker of a needed pool could ever hold is refused before any work."""
        pools = [("decode", self.pool.decode)]
        if not self.config.colocated:
            pools.append(("prefill", self.pool.prefill))
        for name, workers in pools:
            known = [w for w in workers.values() if w.stats is not None and w.healthy]
            sizes = [w.load() for w in known if not w.refused]  # another model's: never used
            if not sizes:
                continue  # nothing known yet: the workers themselves refuse it
            best = max(sizes, key=lambda w: w.num_blocks)
            if not best.can_hold(num_prompt_tokens):
                raise ResourceError(
                    f"no {name} worker can hold {num_prompt_tokens} prompt tokens: the largest "
                    f"holds {best.num_blocks * best.block_size} tokens of KV cache"
                )

    async def Generate(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        """A server stream written with ``context.write`` (not yielded): each write is bounded
        by ``client_idle_timeout_s``, so a client that stops reading is cancelled, and what it
        held on the workers freed, instead of pinning them forever."""
        with self.track():
            await self._generate(data, context)

    async def _generate(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        start_s = time.perf_counter()
        if not self.authorized(bearer(context.invocation_metadata())):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required: metadata authorization: Bearer <key>",
            )
        if self.draining or self._pool is None:
            state = "draining" if self.draining else "still loading"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"router is {state}")
        # A large body is parsed off the event loop (megabytes of ids take milliseconds).
        parsed = (
            parse_request(data)
            if len(data) < _PARSE_IN_THREAD_BYTES
            else await asyncio.to_thread(parse_request, data)
        )
        if isinstance(parsed, Unparsable):
            metrics.REQUEST_ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed.message)
        assert isinstance(parsed, router_pb2.GenerateRequest)
        try:
            prompt_ids, params = await self.read(parsed)
        except (ResourceError, Overloaded) as exc:
            metrics.REQUEST_ERRORS.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            metrics.REQUEST_ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        client_id = parsed.request_id or uuid.uuid4().hex
        stream = self.responses(client_id, prompt_ids, params, start_s)
        try:
            async with contextlib.aclosing(stream):
                async for response in stream:
                    async with asyncio.timeout(self.config.client_idle_timeout_s):
                        await context.write(response)
        except TimeoutError:
            metrics.CLIENT_IDLE_CANCELS.inc()
            logger.warning(
                "request_id=%s cancelled: the client read nothing for %.0f s",
                client_id,
                self.config.client_idle_timeout_s,
            )
            await context.abort(
                grpc.StatusCode.CANCELLED,
                f"the client read nothing for client_idle_timeout_s="
                f"{self.config.client_idle_timeout_s}",
            )
        except WorkerError as exc:
            await context.abort(exc.code, exc.message)


class InFlight:
    """A request counted in flight (``RouterService.track``); ``end`` is idempotent."""

    def __init__(self, service: RouterService) -> None:
        self._service: RouterService | None = service

    def end(self) -> None:
        if self._service is not None:
            self._service._ended()
            self._service = None

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
