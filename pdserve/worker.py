"""What the prefill and decode services share: engine start-up, stats, request accounting."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import grpc

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from pdserve import metrics
from pdserve.async_engine import AsyncEngine
from pdserve.convert import stats_to_proto
from pdserve.server import Service
from pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)


class WorkerService(Service):
    """A service around one engine. Subclasses add their RPCs."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self._engine: AsyncEngine | None = None
        self._inflight = 0

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._engine

    async def load(self) -> None:
        llm_engine = await asyncio.to_thread(LLMEngine, self.engine_config)
        self._engine = AsyncEngine(llm_engine, on_stats=metrics.observe_engine)
        self._engine.start()
        metrics.observe_engine(self._engine.stats)

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.close()

    def num_inflight(self) -> int:
        return self._inflight

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Counts a request in flight (drain waits for it)."""
        self._inflight += 1
        try:
            yield
        finally:
            self._inflight -= 1

    async def check_accepting(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining or self._engine is None:
            state = "draining" if self.draining else "still loading"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is {state}")

    def stats(self) -> common_pb2.WorkerStats:
        engine = self.engine.engine
        return stats_to_proto(
            self.engine.stats,
            engine.kv_layout,
            block_size=engine.block_size,
            max_model_len=engine.max_model_len,
            num_inflight=self._inflight,
            draining=self.draining,
        )
