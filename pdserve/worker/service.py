"""What the prefill and decode services share: engine start-up, stats, request accounting, and
the worker's ``Membership`` in the cluster (registry heartbeats, prefix-index events, drain)."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator

import grpc

from engine.config import DEFAULT_MAX_BUFFERED_TOKENS, EngineConfig
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from engine.serving_engine import EngineBuilder, EngineDeadError, EngineHooks, ServingEngine
from pdserve.cluster.config import RedisConfig
from pdserve.cluster.membership import Membership
from pdserve.cluster.registry import WorkerRecord, WorkerState
from pdserve.common import metrics
from pdserve.common.convert import sampling_from_proto, stats_to_proto
from pdserve.common.engine_fault import engine_fault_trailers
from pdserve.common.role import Role
from pdserve.common.server import NOT_ACCEPTING, Service
from pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)


class WorkerService(Service):
    """A service around one engine, which it reaches only through ``ServingEngine``.
    Subclasses add their RPCs. ``build_engine``: the engine the config's backend names, given
    by the component builder (``app.components.engine_builder``); the shell knows no engine."""

    role: Role

    def __init__(
        self,
        engine_config: EngineConfig,
        redis: RedisConfig | None = None,
        worker_id: str | None = None,
        *,
        max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS,
        heartbeat_s: float | None = None,
        build_engine: EngineBuilder,
    ) -> None:
        self._build_engine = build_engine
        self.trace_name = f"pdserve-{self.role.value}"  # continues the router's traces
        self.engine_config = engine_config
        self.max_buffered_tokens = max_buffered_tokens
        self.heartbeat_s = heartbeat_s
        self.redis = redis
        self.worker_id = worker_id or f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        self._engine: ServingEngine | None = None
        self._inflight = 0
        self._membership: Membership | None = None
        self._observer = metrics.EngineObserver()

    def alive(self) -> bool:
        """Not while the engine has had work and completed no step for liveness_stall_s
        (engine/step_progress.py): restarting is the one cure for a hung device."""
        engine = self._engine
        if engine is None:
            return True  # loading: the startup probe's business
        stalled_s = engine.progress.stalled_s()
        return stalled_s < self.engine_config.liveness_stall_s

    @property
    def membership(self) -> Membership | None:
        return self._membership

    @property
    def engine(self) -> ServingEngine:
        if self._engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._engine

    async def load(self) -> None:
        hooks = EngineHooks(
            on_stats=self._observe,
            on_dead=self._on_engine_dead,
            max_buffered_tokens=self.max_buffered_tokens,
            heartbeat_s=self.heartbeat_s,
        )
        self._engine = await self._build_engine(self.engine_config, hooks)
        metrics.observe_kv_layout(self._engine.kv_layout)
        # Read at scrape time: a stuck step updates nothing.
        metrics.ENGINE_STALLED.set_function(self._engine.progress.stalled_s)
        self._engine.start()
        self._observer(self._engine.stats)
        await self.prepare()
        if self.redis is not None:
            self._membership = Membership(
                self.redis, self._engine, self.record, self._on_drain_request
            )
            self._membership.start()

    async def prepare(self) -> None:
        """Called by ``load`` once the engine runs, before the worker is announced in the
        registry: what its record names (a prefill worker's KV sender) must exist by then."""
        return None

    def _observe(self, stats: EngineStats) -> None:
        self._observer(stats, self.engine.num_buffered_tokens)

    def record(self) -> WorkerRecord:
        """This worker as the registry shows it."""
        engine = self.engine
        stats = engine.stats
        return WorkerRecord(
            worker_id=self.worker_id,
            role=self.role,
            address=self.address,
            model_fingerprint=engine.fingerprint,
            block_size=engine.block_size,
            num_blocks=engine.num_blocks,
            state=WorkerState.DRAINING if self.draining else WorkerState.SERVING,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_free_blocks=stats.num_free_blocks,
            num_cached_blocks=stats.num_cached_blocks,
        )

    def _on_engine_dead(self, exc: BaseException) -> None:
        # A failed step leaves the engine untrusted: stop taking work (health NOT_SERVING,
        # deregister) and exit non-zero, so the supervisor (kubelet, Ray, pdserve up) restarts us.
        logger.error("worker_id=%s engine dead (%r): stopping", self.worker_id, exc)
        self.failure = exc
        if self.request_stop is not None:
            self.request_stop()

    def _on_drain_request(self) -> None:
        logger.info("worker_id=%s drain requested through the registry", self.worker_id)
        if self.request_stop is not None:
            self.request_stop()

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> None:
        self.draining = True
        if self._membership is not None:
            self._membership.heartbeat_now()  # routers stop sending new work at once
        await super().drain(timeout_s, poll_s)

    async def close(self) -> None:
        if self._membership is not None:
            await self._membership.stop()  # deregistered: no routing, no stale index entries
        if self._engine is not None:
            await self._engine.close()

    def num_inflight(self) -> int:
        return self._inflight

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Counts a request in flight (drain waits for it)."""
        self._inflight += 1
        try:
            yield
        finally:
            self._inflight -= 1

    async def check_accepting(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining or self._engine is None:
            state = "draining" if self.draining else "still loading"
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.name} is {state}",
                trailing_metadata=(NOT_ACCEPTING,),
            )

    async def accept(
        self,
        context: grpc.aio.ServicerContext,
        request_id: str,
        sampling: common_pb2.SamplingParams,
    ) -> SamplingParams:
        """The checks every request RPC shares: serving, an id, valid sampling."""
        await self.check_accepting(context)
        try:
            if not request_id:
                raise ValueError("request_id is empty")
            return sampling_from_proto(sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # not reached: context.abort raises

    async def check_fingerprint(self, context: grpc.aio.ServicerContext, fingerprint: str) -> None:
        """A caller that names another model or KV layout is refused before any work: its
        tokens would mean nothing here (empty: the caller does not say)."""
        if fingerprint and fingerprint != self.engine.fingerprint:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model_fingerprint {fingerprint}: this {self.role.value} worker serves "
                f"{self.engine.fingerprint}",
            )

    async def check_fits(self, context: grpc.aio.ServicerContext, num_prompt_tokens: int) -> None:
        """A prompt this worker's whole cache could never hold is refused before any work."""
        needed, held = self.engine.blocks_for(num_prompt_tokens), self.engine.num_blocks
        if needed > held:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prompt_token_ids needs {needed} KV blocks of {self.engine.block_size} tokens; "
                f"this {self.role.value} worker holds {held} in all",
            )

    async def abort_engine_dead(
        self, context: grpc.aio.ServicerContext, exc: EngineDeadError
    ) -> None:
        """A call whose engine died: UNAVAILABLE, with the engine's last words on its request
        (``pdserve/common/engine_fault.py``)."""
        trailers = engine_fault_trailers(exc.evidence)
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=trailers)

    def inject_faults(self, request_id: str, prompt: list[int]) -> None:
        """``--fault-exit-on-token``: a prompt holding the token ends the process at once, as a
        prompt that crashes the engine would (tests of poison prompts)."""
        token = self.engine_config.fault_exit_on_token
        if token is not None and token in prompt:
            logger.error("request_id=%s: fault injection: exiting on token %d", request_id, token)
            logging.shutdown()
            os._exit(70)

    def stats(self) -> common_pb2.WorkerStats:
        engine = self.engine
        return stats_to_proto(
            engine.stats,
            engine.kv_layout,
            block_size=engine.block_size,
            max_model_len=engine.max_model_len,
            num_inflight=self._inflight,
            draining=self.draining,
            engine_stalled_s=engine.progress.stalled_s(),
        )
