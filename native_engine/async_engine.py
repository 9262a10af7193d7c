"""The native engine as the services drive it: one ``LLMEngine`` stepped from asyncio
(``engine/step_loop.py``), behind the ``ServingEngine`` contract (``engine/serving_engine.py``).

KV reads and writes for transfers touch only pinned or reserved blocks, which no step reads or
writes, so transfers use ``kv_cache`` from their own threads without the loop's lock. Each
request's output waits in its ``UpdateQueue`` (``engine/update_queue.py``: the bound, the
heartbeats); a paused request keeps its blocks in the engine, with no seat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.block_hash import BlockHash
from engine.config import DEFAULT_MAX_BUFFERED_TOKENS
from engine.fault_injection import FaultInjection
from engine.guide import Guide
from engine.kv_events import CacheTier, KVEvents
from engine.kv_layout import KVCacheLayout
from engine.outputs import EngineStats, PrefilledRequest, RequestUpdate
from engine.sampling_params import SamplingParams
from engine.serving_engine import (
    EngineDeadError,
    FaultEvidence,
    NoRoomError,
    ServingEngine,
    raise_on_error,
)
from engine.spilled_block import SpillSink
from engine.step_loop import StepLoop, Stepping
from engine.step_progress import StepProgress
from engine.update_queue import UpdateQueue
from native_engine.kv_cache import KVCache
from native_engine.llm_engine import LLMEngine
from native_engine.prefix_share import PrefixShare

logger = logging.getLogger(__name__)

T = TypeVar("T")


__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine(ServingEngine):
    def __init__(
        self,
        engine: LLMEngine,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
        *,
        max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS,
        heartbeat_s: float | None = None,
        faults: FaultInjection | None = None,
        step_thread: ThreadPoolExecutor | None = None,
    ) -> None:
        """``step_thread``: the thread ``engine`` was built on (``native_engine.builder``), for its
        steps; else a new one."""
        if max_buffered_tokens < 2:
            raise ValueError(f"max_buffered_tokens must be >= 2, got {max_buffered_tokens}")
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self._engine = engine
        self.prefix_share = PrefixShare(engine)
        self._on_step = on_stats
        self._on_dead = on_dead  # told once, when a step fails
        self.max_buffered_tokens = max_buffered_tokens
        self.heartbeat_s = heartbeat_s
        self._faults = faults or FaultInjection()  # tests only (engine/fault_injection.py)
        self._streams: dict[str, UpdateQueue] = {}
        self.error: BaseException | None = None
        self.collect_kv_events = False  # set by a worker that publishes to a prefix index
        self._kv_events: list[KVEvents] = []
        # Refreshed after every step and every call: stats RPCs must not wait behind a long
        # step (a 2k-token prefill can take seconds), or routers think the worker is dead.
        self.stats: EngineStats = engine.stats()
        stepping = Stepping(
            has_work=engine.has_unfinished_requests,
            step=self._step,
            deliver=self._deliver,
            refresh=self._refresh_stats,
            before_step=self._wait_for_copy,
        )
        self._loop = StepLoop(stepping, "engine-loop", StepProgress(), step_thread)
        self.progress = self._loop.progress
        engine.wait_for_copies_in_step = False  # the loop waits for them, outside the lock

    # ---- what the model is (fixed once loaded) ---------------------------------------------
    @property
    def kv_cache(self) -> KVCache:
        return self._engine.kv_cache

    @property
    def kv_pages(self) -> KVCache:
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

    @property
    def num_buffered_tokens(self) -> int:
        """Output tokens produced but not yet taken by their consumers, over all requests."""
        return sum(s.num_buffered_tokens for s in self._streams.values())

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start(self._die)

    async def close(self) -> None:
        await self._loop.close()

    # ---- requests ---------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        num_generated_tokens: int = 0,
    ) -> AsyncGenerator[RequestUpdate, None]:
        """Admits a request and yields its updates. ``prefill_only``: the last update is the
        prefilled one (blocks pinned: the caller then owns a ``free_pinned``).
        ``num_generated_tokens``: a continued request (see ``LLMEngine.add_request``)."""

        def admit(guide: Guide | None) -> None:
            self._engine.add_request(
                prompt_ids,
                params,
                request_id,
                prefill_only=prefill_only,
                num_generated_tokens=num_generated_tokens,
                guide=guide,
            )

        earlier = prompt_ids[len(prompt_ids) - num_generated_tokens :]
        self._faults.admitted(request_id, prompt_ids)
        return self._stream(request_id, admit, params, earlier)

    async def admit_prefilled(
        self, request: PrefilledRequest, fill: Callable[[list[int]], Awaitable[T]]
    ) -> T:
        ids, num_generated = request.prompt_token_ids, request.num_generated_tokens
        self._faults.admitted(request.request_id, ids)
        guide = await self._prepare_guide(request.params, ids[len(ids) - num_generated :])
        block_ids = await self.call(lambda: self._engine.reserve_prefilled(request, guide))
        if block_ids is None:
            needed = self.blocks_for(len(request.prompt_token_ids))
            raise NoRoomError.of(self.stats.num_free_blocks, self.num_blocks, needed)
        try:
            return await fill(block_ids)
        except BaseException:
            # fill has stopped writing (its contract): the reserved blocks go back.
            await self.abort(request.request_id)
            raise

    def stream_prefilled(self, request: PrefilledRequest) -> AsyncGenerator[RequestUpdate, None]:
        """Joins the admitted request (its KV is written) to the batch."""
        return self._stream(request.request_id, lambda _: self._engine.start_prefilled(request))

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

    # ---- peer pull (native_engine/prefix_share.py) ----------------------------------------
    async def lend_prefix(
        self, lease_id: str, token_ids: list[int], first_block: int, num_blocks: int
    ) -> list[int]:
        share = self.prefix_share
        lent = await self.call(lambda: share.lend(lease_id, token_ids, first_block, num_blocks))
        if lent.copy is not None:  # host-tier blocks: copied in before anything reads them
            copy = asyncio.wrap_future(lent.copy)
            try:
                await asyncio.shield(copy)
            except BaseException:
                await asyncio.wait([copy])  # it stops writing before the blocks go back
                await self.free_pinned(lease_id)
                raise
        return lent.block_ids

    async def borrow_prefix(
        self,
        borrow_id: str,
        token_ids: list[int],
        num_blocks: int,
        fill: Callable[[int, list[int]], Awaitable[int]],
    ) -> int:
        share = self.prefix_share
        borrowed = await self.call(lambda: share.borrow(borrow_id, token_ids, num_blocks))
        if borrowed is None or not borrowed.block_ids:
            return 0
        try:
            written = await fill(borrowed.first_block, borrowed.block_ids)
        except BaseException:
            # Nothing landed: the blocks it took go back now, not with the request.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.call(lambda: share.landed(borrow_id, 0)))
            raise
        await self.call(lambda: share.landed(borrow_id, written))
        return written

    async def give_back(self, borrow_id: str) -> None:
        if self.error is None:  # a dead engine's blocks go with it
            await asyncio.shield(self.call(lambda: self.prefix_share.give_back(borrow_id)))

    def spill_evicted(self, sink: SpillSink) -> bool:
        """The host tier's evictions (blocks the device cache evicts go to the host tier)."""
        tier = self._engine.host_tier
        if tier is None:
            return False
        tier.spill = sink
        return True

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs a (fast) engine call between steps."""
        self._check_alive()
        # And again under the lock: the engine may have died while the call waited for it.
        return await self._loop.call(fn, self._check_alive)

    def _refresh_stats(self) -> None:
        self.stats = self._engine.stats()
        # Drained under the lock, after every step and call, so the log never grows unbounded.
        for log, tier in self._engine.kv_event_logs():
            events = log.drain(tier)
            if self.collect_kv_events and not events.empty:
                self._kv_events.append(events)
        if self._on_step is not None:
            self._on_step(self.stats)

    async def _prepare_guide(self, params: SamplingParams, earlier: list[int]) -> Guide | None:
        """A guided request's matcher (its grammar compiled, replayed past ``earlier``, its
        first position checked) in a worker thread, outside the lock, before admission: the
        event loop and the engine's lock never wait for a grammar."""
        if params.structured is None:
            return None
        return await asyncio.to_thread(self._engine.intake.prepare_guide, params, earlier)

    async def _stream(
        self,
        request_id: str,
        admit: Callable[[Guide | None], RequestUpdate | None],
        params: SamplingParams | None = None,
        earlier: list[int] | None = None,
    ) -> AsyncGenerator[RequestUpdate, None]:
        """Runs ``admit`` (an engine call that adds ``request_id``, given the request's
        matcher when ``params`` are guided) between steps, then yields the request's updates
        until it finishes or is prefilled. Leaving early, by cancellation or ``aclose``,
        aborts the request. Raises ``RequestError`` when the request's own parameters end it."""
        self._check_alive()
        guide = await self._prepare_guide(params, earlier or []) if params else None
        stream = UpdateQueue()

        def admitted() -> RequestUpdate | None:
            first = admit(guide)
            self._streams[request_id] = stream
            return first

        first = await self.call(admitted)
        done = False
        try:
            if first is not None:
                done = first.finished or first.prefilled
                yield raise_on_error(first)
            while not done:
                update = await self._next(request_id, stream)
                done = update.finished or update.prefilled
                yield raise_on_error(update)
        finally:
            self._streams.pop(request_id, None)
            self._faults.ended(request_id)
            if not done and self.error is None:
                # Shielded inside abort: a second cancellation must not skip freeing the blocks.
                await self.abort(request_id)

    async def _next(self, request_id: str, stream: UpdateQueue) -> RequestUpdate:
        item = await stream.take(request_id, self.heartbeat_s)
        if stream.wants_resume(self.max_buffered_tokens):
            stream.paused = False
            await self.call(lambda: self._engine.resume(request_id))
        return item

    # ---- the prefix index's view ------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvents]:
        """KV events since the last take, oldest first (event-loop thread only)."""
        events, self._kv_events = self._kv_events, []
        return events

    async def snapshot_cached_hashes(self) -> dict[CacheTier, list[BlockHash]]:
        """Every cached block hash per tier, with the pending events dropped in the same
        breath: the snapshot already contains them."""

        def snapshot() -> dict[CacheTier, list[BlockHash]]:
            hashes = self._engine.cached_hashes()
            for log, _ in self._engine.kv_event_logs():
                log.drain()
            self._kv_events = []
            return hashes

        return await self.call(snapshot)

    def _check_alive(self) -> None:
        """A call after the engine died: the request it is for was in no step of it."""
        if self.error is not None:
            evidence = FaultEvidence.BYSTANDER
            raise EngineDeadError(f"engine step failed: {self.error!r}", evidence)

    def _die(self, exc: BaseException) -> None:
        """Every stream and the worker are told at once, with the engine's last words on each
        request: whether the step that failed held it."""
        logger.error("engine step failed; failing every request", exc_info=exc)
        self.error = exc
        stepping = self._engine.stepping if self._loop.in_step else None
        for request_id, stream in self._streams.items():
            stream.fail(EngineDeadError.of_step(exc, request_id, stepping))
        if self._on_dead is not None:
            self._on_dead(exc)

    async def _wait_for_copy(self) -> None:
        """A host-tier copy gates the next step. The lock is free: calls go on meanwhile. A
        failed copy fails the next step (which reads the future), the path every engine
        failure takes."""
        copy = self._engine.take_copy_wait()
        if copy is not None:
            await asyncio.wait([asyncio.wrap_future(copy)])

    def _step(self) -> list[RequestUpdate]:
        """One engine step (in the step thread)."""
        engine = self._engine
        number = self.progress.num_steps + 1
        return self._faults.around_step(number, engine.step, lambda: engine.stepping)

    def _deliver(self, updates: list[RequestUpdate]) -> bool:
        """Queues each update for its consumer (under the lock, right after the step), and
        pauses a request whose consumer has let ``max_buffered_tokens`` pile up: one step adds
        at most 1 + k tokens per request (k: speculative tokens, 0 without speculation), so its
        queue never holds more than the bound + k. True: the step scheduled nothing."""
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is None:
                continue
            stream.put(update)
            full = stream.full(self.max_buffered_tokens)
            if full and not stream.paused and not update.finished:
                stream.paused = self._engine.pause(update.request_id)
        return self._engine.last_step_idle
