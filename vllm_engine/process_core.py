"""vLLM's engine core in a process of its own (``VllmEngineCore.PROCESS``; the contract is
``vllm_engine/core_driver.py``), as ``vllm serve`` runs it: the engine core steps itself, and
this front-end drives it through vLLM's public client, ``AsyncLLM``.

What pdserve needs of it comes through public interfaces only:
- outputs: each request's ``RequestOutputCollector`` (``AsyncLLM.add_request``), read by one
  task per request;
- queue depths, free blocks, step progress: ``SchedulerStats``, through a stat logger
  (``CoreStats``) that vLLM calls on this event loop with every step's outputs;
- the prefix index: vLLM's ZMQ KV-event publisher (``vllm_engine/events.py``);
- blocks allocated and pinned: the connector's scheduler half, through the hub
  (``vllm_engine/core_channel.py``); what vLLM must be told (a lease ended, a pull stopped)
  goes to every rank as soon as the engine's bridge has it, and vLLM's engine core keeps
  stepping while a request waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from vllm import SamplingParams as VllmParams
from vllm.config import VllmConfig
from vllm.distributed.kv_events import EventBatch
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats

from vllm_engine.bridge import Bridge
from vllm_engine.core_driver import CoreCallbacks, CoreDriver
from vllm_engine.events import EventSubscriber
from vllm_engine.rank_hub import RankHub

logger = logging.getLogger(__name__)
T = TypeVar("T")
# How often the front-end looks whether vLLM's client saw its engine core die (an idle
# engine has no stream to hear it on).
DEATH_POLL_S = 1.0


class CoreStats(StatLoggerBase):
    """vLLM's stat logger for one engine core: keeps its last ``SchedulerStats`` and says a
    step completed (vLLM records every step's outputs, on the front-end's event loop)."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.last = SchedulerStats()
        self.on_step: Callable[[bool], None] | None = None

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        changed = iteration_stats is not None  # tokens were produced
        if scheduler_stats is not None:
            changed = changed or _counts(scheduler_stats) != _counts(self.last)
            self.last = scheduler_stats
        if self.on_step is not None:
            self.on_step(changed)

    def log_engine_initialized(self) -> None:
        return None


def _counts(stats: SchedulerStats) -> tuple[int, int, int, float]:
    return (
        stats.num_running_reqs,
        stats.num_waiting_reqs,
        stats.num_skipped_waiting_reqs,
        stats.kv_cache_usage,
    )


class ProcessCore(CoreDriver):
    def __init__(
        self,
        llm: AsyncLLM,
        bridge: Bridge,
        hub: RankHub,
        stats: CoreStats,
        events: EventSubscriber,
    ) -> None:
        super().__init__(llm.model_config.max_model_len, llm.model_config.get_vocab_size())
        self._llm, self._bridge, self._hub = llm, bridge, hub
        self._stats, self._events = stats, events
        cache = llm.vllm_config.cache_config
        assert cache.num_gpu_blocks is not None, "the engine core reports its blocks at start"
        self._num_blocks = cache.num_gpu_blocks - 1  # block 0 is vLLM's null block
        self._commands: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._readers: dict[str, asyncio.Task[None]] = {}  # by request id
        # Each add's number, until its request is aborted: a reader is made only for the add
        # still current (an abort may come while the add is in flight, and the id come back).
        self._adds = itertools.count()
        self._current: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._reported = asyncio.Event()
        self._callbacks: CoreCallbacks | None = None
        self._dead = False

    def start(self, callbacks: CoreCallbacks) -> None:
        self._callbacks = callbacks
        self._stats.on_step = self._stepped
        self._bridge.on_report = self._reported.set
        for name, coroutine in (
            ("vllm-commands", self._run_commands()),
            ("vllm-reports", self._push_reports()),
            ("vllm-events", self._events.run()),
            ("vllm-death", self._watch_death()),
        ):
            self._tasks.append(asyncio.create_task(self._guarded(coroutine), name=name))

    async def close(self) -> None:
        for task in [*self._tasks, *self._readers.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._readers.values(), return_exceptions=True)
        self._events.close()
        self._llm.shutdown()  # the engine core, and with it its ranks

    async def call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            self._refresh()

    def add(self, rid: str, prompt_token_ids: list[int], params: VllmParams, priority: int) -> None:
        self.progress.working()
        number = self._current[rid] = next(self._adds)
        self._commands.put_nowait(("add", (rid, number, prompt_token_ids, params, priority)))

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self._current.pop(rid, None)
            reader = self._readers.pop(rid, None)
            if reader is not None:
                reader.cancel()
        self._commands.put_nowait(("abort", rids))

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def counts(self) -> tuple[int, int]:
        last = self._stats.last
        # Waiting includes the requests parked for their remote KV (vLLM counts them apart),
        # as the in-process scheduler's own counts do.
        return last.num_running_reqs, last.num_waiting_reqs + last.num_skipped_waiting_reqs

    def num_free_blocks(self) -> int:
        return round((1.0 - self._stats.last.kv_cache_usage) * self._num_blocks)

    def take_event_batches(self) -> list[EventBatch]:
        return self._events.take()

    # ---- tasks ------------------------------------------------------------------------------
    async def _guarded(self, coroutine: Any) -> None:
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._die(exc)

    async def _run_commands(self) -> None:
        """Adds and aborts in the order the table made them (an abort never overtakes its
        add: a request that paused and resumed is aborted, then added again)."""
        while True:
            kind, arg = await self._commands.get()
            if kind == "add":
                rid, number, prompt_token_ids, params, priority = arg
                try:
                    collector = await self._llm.add_request(
                        rid, {"prompt_token_ids": prompt_token_ids}, params, priority=priority
                    )
                except EngineDeadError:
                    raise
                except Exception as exc:  # vLLM's input checks (VLLMValidationError, ...)
                    if self._current.get(rid) == number:  # else aborted, or added again
                        self._refused(rid, exc)
                    continue
                if self._current.get(rid) == number:  # not aborted while it was added
                    old = self._readers.pop(rid, None)
                    if old is not None:
                        old.cancel()
                    reader = asyncio.create_task(
                        self._read(rid, number, collector), name=f"vllm-{rid}"
                    )
                    self._readers[rid] = reader
            else:
                await self._llm.abort(arg)

    def _refused(self, rid: str, exc: Exception) -> None:
        """That request alone fails; an engine left with nothing to do is idle, not stalled."""
        self._current.pop(rid, None)
        assert self._callbacks is not None
        self._callbacks.refuse(rid, exc)
        running, waiting = self.counts()
        if not self._readers and running + waiting <= self._bridge.num_loading:
            self.progress.progressed(stepped=False)

    async def _read(self, rid: str, number: int, collector: Any) -> None:
        assert self._callbacks is not None
        while True:
            try:
                output = await collector.get()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # vLLM's client: the engine core died
                self._die(exc)
                return
            if output.finished and self._readers.get(rid) is asyncio.current_task():
                del self._readers[rid]
                if self._current.get(rid) == number:
                    del self._current[rid]
            try:
                self._callbacks.deliver([output])
            except Exception as exc:  # a delivery that fails kills the engine (its loop's rule)
                self._die(exc)
                return
            self._refresh()
            if output.finished:
                return

    async def _push_reports(self) -> None:
        """What vLLM must be told, to every rank as soon as the bridge has it (vLLM frees or
        schedules a request once every rank reported it)."""
        while True:
            await self._reported.wait()
            self._reported.clear()
            reports = self._bridge.take_reports()
            await self._hub.report(reports)
            # Every rank has them: vLLM's step takes them (nothing here waits for that step).
            self._bridge.seen(reports.finished_sending, reports.finished_recving)

    async def _watch_death(self) -> None:
        while not self._llm.errored:
            await asyncio.sleep(DEATH_POLL_S)
        raise self._llm.dead_error

    def _stepped(self, changed: bool) -> None:
        """A step's stats arrived; ``changed``: they differ from the last (vLLM steps every
        millisecond while a request waits for a report: those steps refresh nothing)."""
        self.progress.progressed(stepped=changed)
        running, waiting = self.counts()
        if running + waiting > self._bridge.num_loading:
            self.progress.working()
        if changed:
            self._refresh()

    def _die(self, exc: BaseException) -> None:
        if self._callbacks is not None and not self._dead:
            self._dead = True
            with contextlib.suppress(Exception):
                self._callbacks.refresh()
            self._callbacks.die(exc)

    def _refresh(self) -> None:
        if self._callbacks is not None:
            self._callbacks.refresh()
