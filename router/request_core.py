"""The router's request core: what every public frontend shares, and the one thing they stand
on. The gRPC servicer (``router/service.py``) and the OpenAI HTTP app (``router/openai``) each
take a ``RequestCore``; neither imports the other.

A request goes: ``authorized`` (API keys), ``refusal`` (draining, loading), ``track`` (counted
in flight until its last byte: drain waits for it), ``tenant`` (whose it is), ``read`` (its
class first, then sizes and counts: ``router/limits.py``; tokenization off the event loop:
``router/prompts.py``; then whether any worker could ever hold the prompt), ``responses``
(flow control's admission and wait: ``router/waiting_room.py``; then
``router/generation.py``'s stream under a request id unique on the workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator
from typing import Protocol

from engine.checkpoint import CheckpointInfo
from engine.fingerprint import engine_fingerprint
from engine.sampling_params import InvalidField
from engine.tokenizer import Tokenizer
from pdserve.common import metrics
from pdserve.common.auth import ApiKeys
from router.cluster_state import ClusterState
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.generation import Generation
from router.output_stream import OutputStream
from router.prompts import Overloaded, PromptReader
from router.request import Request
from router.request_class import Tag, Tenant
from router.result import Chunk, Final, Result
from router.waiting_room import Seat, WaitingRoom
from router.worker_errors import WorkerError
from router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)
_MAX_KEY_BYTES = 128  # a fairness header's value


class ResourceError(ValueError):
    """No worker could ever serve the request (RESOURCE_EXHAUSTED, not INVALID_ARGUMENT)."""


class Lifecycle(Protocol):
    """The serving state of the process around the core (``pdserve.common.server.Service``)."""

    draining: bool
    serving: bool


class RequestCore:
    def __init__(self, config: RouterConfig, lifecycle: Lifecycle) -> None:
        self.config = config
        self.lifecycle = lifecycle
        self.checkpoint = CheckpointInfo.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.api_keys = ApiKeys(config.api_key_file) if config.api_key_file else None
        self.prompts = PromptReader(
            self.tokenizer,
            self.checkpoint.vocab_size,
            config.limits,
            self.checkpoint.eos_token_ids,
        )
        self._pool: WorkerPool | None = None
        self._cluster: ClusterState | None = None
        self._generation: Generation | None = None
        self._room: WaitingRoom | None = None
        self._inflight = 0

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
    def room(self) -> WaitingRoom:
        if self._room is None:
            raise RuntimeError("the router is not loaded yet")
        return self._room

    async def load(self) -> None:
        """Builds the pool, the cluster state and the generation path; waits for workers."""
        config = self.config
        # Channels belong to the running event loop, so the pool is built here.
        self._pool = WorkerPool(
            config.prefill_addresses,
            config.decode_addresses,
            config.decode_policy,
            tls=config.server.tls,
            stall_timeout_s=config.stall_timeout_s,
        )
        layout = config.layout
        fingerprint = await asyncio.to_thread(engine_fingerprint, config.model, layout)
        self._cluster = ClusterState(config.redis, self._pool, fingerprint, layout.block_size)
        dispatch = Dispatcher(config, self._pool, self._cluster)
        self._generation = Generation(config, self._pool, dispatch, self.checkpoint.eos_token_ids)
        self._room = WaitingRoom(
            config.flow, self._prompt_workers, num_decode_workers=self._decode_workers
        )
        room = self._room

        def per_worker() -> float:  # what flow control measures, for the cost policy
            workers = max(1, self._prompt_workers())
            return room.rate.tokens_per_s(workers) / workers

        dispatch.prefill_tokens_per_s = per_worker
        await self._cluster.wait_ready(config.ready_timeout_s, needs_prefill=not config.colocated)
        self._cluster.start(config.stats_interval_s)

    async def close(self) -> None:
        if self._cluster is not None:
            await self._cluster.close()
        if self._generation is not None:
            await self._generation.dispatch.close()
        if self._pool is not None:
            await self._pool.close()

    def num_inflight(self) -> int:
        return self._inflight

    def authorized(self, authorization: str | None) -> bool:
        if self.api_keys is None or self.api_keys.allows(authorization):
            return True
        metrics.AUTH_FAILURES.inc()
        return False

    def caller(self, authorization: str | None, peer: str) -> str:
        """Who sends an authorized request, as strikes count it (``router/quarantine.py``):
        its API key (a digest) when keys are required, else its host (``peer``: a gRPC peer
        such as ``ipv4:10.0.0.7:5123``, or an HTTP client's host)."""
        if self.api_keys is not None:
            return f"key:{self.api_keys.identity(authorization)}"
        return f"host:{peer_host(peer)}"

    def tenant(self, authorization: str | None, peer: str, header: str | None) -> Tenant:
        """Whose an authorized request is (docs/slo.md): the value of the operator's fairness
        header (``header``, when it names one and the request carries it), else its caller;
        with what its API key's line names. Raises ``InvalidField`` naming the header."""
        attributes = self.api_keys.attributes(authorization) if self.api_keys else {}
        caller = self.caller(authorization, peer)
        tenant = Tenant(caller, caller, attributes.get("class"), _number(attributes))
        if header is None:
            return tenant
        name = self.config.flow.fairness_header
        if not header or len(header) > _MAX_KEY_BYTES or not header.isprintable():
            message = f"header {name} must be 1 to {_MAX_KEY_BYTES} printable characters"
            raise InvalidField(str(name), message)
        return dataclasses.replace(tenant, key=f"header:{header}")

    def tag(self, request: Request) -> Tag:
        """What flow control reads of ``request``: its class (its own, else its API key's,
        else the router's default), priority and targets. Raises ``InvalidField``."""
        flow = self.config.flow
        tenant = request.tenant or Tenant(request.caller, request.caller)
        name = request.service_class or tenant.default_class or flow.default_class
        found = flow.named(name)
        if found is None:
            if request.service_class is None:  # the key file's mistake, not the client's
                logger.warning("API key class %r is not a request class: using the default", name)
                found = flow.default
            else:
                names = ", ".join(c.name for c in flow.classes)
                message = f"service_class {name!r} is not a request class of this router ({names})"
                raise InvalidField("service_class", message)
        return Tag(tenant.key, found, request.priority, request.slo)

    def refusal(self) -> str | None:
        """Why this router takes no request now (UNAVAILABLE / 503), or None."""
        if self.lifecycle.draining:
            return "router is draining"
        if self._generation is None or not self.lifecycle.serving:
            return "router is still loading"
        return None

    @property
    def max_model_len(self) -> int:
        """The workers' limit; the model's own until a worker reported one (a bound on what a
        request may carry even then)."""
        return self.pool.max_model_len or self.checkpoint.max_position_embeddings

    async def read(self, request: Request) -> Request:
        """``request`` validated, its prompt as ids. Raises ValueError (INVALID_ARGUMENT),
        ``ResourceError`` or ``Overloaded`` (RESOURCE_EXHAUSTED)."""
        self.tag(request)  # its class exists: checked before any work
        read = await self.prompts.read(request, self.max_model_len)
        self.check_capacity(read.num_prompt_tokens)
        return read

    def _prompt_workers(self) -> int:
        """The workers that compute prompts (flow control's pool), ready or not: none known
        is flow control's 503."""
        workers = self.pool.decode if self.config.colocated else self.pool.prefill
        return sum(1 for w in workers.values() if not w.refused)

    def _decode_workers(self) -> int:
        return sum(1 for w in self.pool.decode.values() if not w.refused)

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

    def track(self, bounded: bool = True) -> InFlight:
        """One public request, counted in flight from its admission to its last byte (drain
        waits for it). Every frontend takes one per request and ends it exactly once.
        ``bounded``: refuse it (``Overloaded``) when ``--max-concurrent-requests`` are in
        flight (its admission); False: a count of a request already admitted (a stream
        outliving its handler)."""
        limit = self.config.limits.max_concurrent_requests
        if bounded and self._inflight >= limit:
            raise Overloaded(
                f"{self._inflight} requests in flight, the router's --max-concurrent-requests "
                f"({limit}); retry"
            )
        self._inflight += 1
        metrics.ROUTER_INFLIGHT.inc()
        metrics.ROUTER_ARRIVALS.inc()
        return InFlight(self)

    def _ended(self) -> None:
        self._inflight -= 1
        metrics.ROUTER_INFLIGHT.dec()

    async def responses(self, request: Request) -> AsyncGenerator[Result, None]:
        """One request's results (``read`` validated it) under a request id unique on the
        workers even if clients reuse theirs, once flow control let it go to them (raises
        ``Shed`` when it does not). Every frontend's (inside its ``track``)."""
        request_id = f"{request.client_id}-{uuid.uuid4().hex[:8]}"
        tag = self.tag(request)
        if request.params.priority != tag.band:  # the workers' engines schedule by it
            params = dataclasses.replace(request.params, priority=tag.band)
            request = dataclasses.replace(request, params=params)
        tenant = request.tenant
        if tenant is not None and tenant.key == tenant.caller:  # the API key's own share
            try:
                self.room.queues.set_weight(tenant.key, tenant.weight)
            except ValueError as exc:
                logger.warning("request_id=%s: API key weight ignored: %s", request_id, exc)
        seat = await self.room.enter(request_id, tag, request.num_prompt_tokens)
        try:
            out = OutputStream(self.tokenizer, request, self.checkpoint.eos_token_ids)
            stream = self.generation.generate(request_id, request, out, seat.queued)
            async with contextlib.aclosing(stream):
                async for response in stream:
                    _account(seat, response)
                    yield response
        except WorkerError as exc:
            metrics.REQUEST_ERRORS.labels(exc.code.name).inc()
            logger.warning("request_id=%s failed: %s %s", request_id, exc.code.name, exc.message)
            raise
        finally:
            seat.leave()


def _account(seat: Seat, response: Result) -> None:
    """Flow control's view of a response: the first token frees the request's prompt tokens;
    each target is met or missed (``pdserve_slo_requests_total``)."""
    targets, name = seat.tag.targets, seat.tag.request_class.name
    if isinstance(response, Chunk) and response.token_ids:
        seat.first_token()
    elif isinstance(response, Final):
        tpot = response.mean_tpot_s if response.completion_tokens > 1 else None
        for target, limit, value in (
            ("ttft", targets.ttft_s, response.ttft_s),
            ("tpot", targets.tpot_s, tpot),
        ):
            if limit is not None and value is not None:
                result = "met" if value <= limit else "missed"
                metrics.SLO_REQUESTS.labels(name, target, result).inc()


def _number(attributes: dict[str, str]) -> float | None:
    """An API key's ``weight=`` (None when absent or not a number: logged)."""
    raw = attributes.get("weight")
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        logger.warning("API key weight %r is not a number: ignored", raw)
        return None


class InFlight:
    """A request counted in flight (``RequestCore.track``); ``end`` is idempotent."""

    def __init__(self, core: RequestCore) -> None:
        self._core: RequestCore | None = core

    def end(self) -> None:
        if self._core is not None:
            self._core._ended()
            self._core = None

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def peer_host(peer: str) -> str:
    """The host of a gRPC peer (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:/path``) or of
    an HTTP client (already a host)."""
    kind, sep, address = peer.partition(":")
    if not sep or kind not in ("ipv4", "ipv6"):
        return peer
    host, _, _ = address.rpartition(":")
    return host.strip("[]") or address
