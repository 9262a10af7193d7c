"""Drives one ``LLMEngine`` from asyncio, for the services: what they need of an engine, and
nothing that lets them reach past it.

The engine is not thread-safe. Steps run in a worker thread so the event loop keeps serving RPCs;
every other engine call runs on the event loop while no step is in flight (one lock, FIFO).
KV reads and writes for transfers touch only pinned or reserved blocks, which no step reads or
writes, so transfers use ``kv_cache`` from their own threads without the lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from engine.block_hash import BlockHash
from engine.kv_cache import KVCache
from engine.kv_events import KVEvents
from engine.kv_layout import KVCacheLayout
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, PrefilledRequest, RequestUpdate
from engine.sampling_params import SamplingParams
from engine.threads import finish_in_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """A step raised: the engine state can no longer be trusted; the worker must restart."""


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._engine = engine
        self._on_step = on_stats
        self._on_dead = on_dead  # told once, when a step fails
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[RequestUpdate | BaseException]] = {}
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.collect_kv_events = False  # set by a worker that publishes to a prefix index
        self._kv_events: list[KVEvents] = []
        # Refreshed after every step and every call: stats RPCs must not wait behind a long
        # step (a 2k-token prefill can take seconds), or routers think the worker is dead.
        self.stats: EngineStats = engine.stats()

    # ---- what the model is (fixed once loaded) ---------------------------------------------
    @property
    def kv_cache(self) -> KVCache:
        return self._engine.kv_cache

    @property
    def kv_layout(self) -> KVCacheLayout:
        return self._engine.kv_layout

    @property
    def fingerprint(self) -> str:
        return self._engine.fingerprint

    @property
    def block_size(self) -> int:
        return self._engine.block_size

    @property
    def num_blocks(self) -> int:
        return self._engine.num_blocks

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    def blocks_for(self, num_tokens: int) -> int:
        return self._engine.blocks_for(num_tokens)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- requests ---------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
    ) -> AsyncGenerator[RequestUpdate, None]:
        """Admits a request and yields its updates. ``prefill_only``: the last update is the
        prefilled one (blocks pinned: the caller then owns a ``free_pinned``)."""

        def admit() -> None:
            self._engine.add_request(prompt_ids, params, request_id, prefill_only=prefill_only)

        return self._stream(request_id, admit)

    async def reserve(self, request: PrefilledRequest) -> list[int] | None:
        """Blocks for a request prefilled elsewhere, or None when the cache has no room now."""
        return await self.call(lambda: self._engine.reserve_prefilled(request))

    def start_prefilled(self, request: PrefilledRequest) -> AsyncGenerator[RequestUpdate, None]:
        """Joins a reserved request whose KV is written; yields from its first token on."""
        return self._stream(request.request_id, lambda: self._engine.start_prefilled(request))

    def export_prefilled(self, request_id: str) -> PrefilledRequest:
        """A pinned request, as the decode side resumes it (no step touches a pinned request,
        so no lock is needed)."""
        return self._engine.export_prefilled(request_id)

    async def free_pinned(self, request_id: str) -> None:
        # Shielded: a cancelled caller must not leave the blocks pinned.
        await asyncio.shield(self.call(lambda: self._engine.free_pinned(request_id)))

    async def abort(self, request_id: str) -> None:
        """Stops a request wherever it is and frees its blocks; a no-op when it is gone."""
        await asyncio.shield(self.call(lambda: self._engine.abort(request_id)))

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs a (fast) engine call between steps."""
        self._check_alive()
        async with self._lock:
            self._check_alive()  # the engine may have died while we waited for the lock
            try:
                return fn()
            finally:
                self._refresh_stats()
                # What the call freed or added may let a stalled scheduler move again.
                self._wakeup.set()

    def _refresh_stats(self) -> None:
        self.stats = self._engine.stats()
        # Drained under the lock, after every step and call, so the log never grows unbounded.
        events = self._engine.block_manager.kv_events.drain()
        if self.collect_kv_events and not events.empty:
            self._kv_events.append(events)
        if self._on_step is not None:
            self._on_step(self.stats)

    async def _stream(
        self, request_id: str, admit: Callable[[], RequestUpdate | None]
    ) -> AsyncGenerator[RequestUpdate, None]:
        """Runs ``admit`` (an engine call that adds ``request_id``) between steps, then yields
        the request's updates until it finishes or is prefilled. Leaving early, by
        cancellation or ``aclose``, aborts the request."""
        self._check_alive()
        queue: asyncio.Queue[RequestUpdate | BaseException] = asyncio.Queue()
        async with self._lock:
            self._check_alive()
            try:
                first = admit()
            finally:
                self._refresh_stats()
            self._queues[request_id] = queue
        self._wakeup.set()
        done = False
        try:
            if first is not None:
                done = first.finished or first.prefilled
                yield first
            while not done:
                update = await queue.get()
                if isinstance(update, BaseException):
                    raise EngineDeadError(f"engine step failed: {update!r}") from update
                done = update.finished or update.prefilled
                yield update
        finally:
            self._queues.pop(request_id, None)
            if not done and self.error is None:
                # Shielded inside abort: a second cancellation must not skip freeing the blocks.
                await self.abort(request_id)

    # ---- the prefix index's view ------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvents]:
        """KV events since the last take, oldest first (event-loop thread only)."""
        events, self._kv_events = self._kv_events, []
        return events

    async def snapshot_cached_hashes(self) -> list[BlockHash]:
        """Every cached block hash, with the pending events dropped in the same breath: the
        snapshot already contains them."""

        def snapshot() -> list[BlockHash]:
            hashes = self._engine.block_manager.cached_hashes()
            self._engine.block_manager.kv_events.drain()
            self._kv_events = []
            return hashes

        return await self.call(snapshot)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine step failed: {self.error!r}")

    async def _run(self) -> None:
        engine = self._engine
        while True:
            await self._wakeup.wait()
            async with self._lock:
                if not engine.has_unfinished_requests():
                    self._wakeup.clear()
                    continue
                try:
                    updates = await finish_in_thread(engine.step)
                except Exception as exc:
                    logger.exception("engine step failed; failing every request")
                    self.error = exc
                    for queue in self._queues.values():
                        queue.put_nowait(exc)
                    if self._on_dead is not None:
                        self._on_dead(exc)
                    return
                self._refresh_stats()
                if engine.last_step_idle:
                    # Nothing could be scheduled (no free blocks): wait for a call to change that
                    # instead of spinning.
                    self._wakeup.clear()
            for update in updates:
                target = self._queues.get(update.request_id)
                if target is not None:
                    target.put_nowait(update)
