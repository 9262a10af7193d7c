"""vLLM's engine core in the worker's process (``VllmEngineCore.WORKER``; the contract is
``vllm_engine/core_driver.py``).

Its steps run in a worker thread so the event loop keeps serving; every other call into vLLM
runs on the event loop while no step is in flight (one lock), exactly as the native
``AsyncEngine`` does. Its one rank runs here too (``--engine-core worker`` is refused with
tensor parallelism): both halves of the connector reach the engine's ``Bridge`` in memory.

The vLLM internals this relies on (``docs/engines.md``, checked by
``tests/vllm/test_vllm_pieces.py``): the in-process engine core behind ``LLMEngine``, its
scheduler's request counts and block pool, and its KV event publisher, replaced by a buffer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from vllm import SamplingParams as VllmParams
from vllm.distributed.kv_events import EventBatch
from vllm.exceptions import VLLMClientError
from vllm.outputs import RequestOutput
from vllm.v1.engine.llm_engine import LLMEngine as VllmLLMEngine

from engine.serving_engine import run_until_dead
from engine.threads import finish_in_thread, step_executor
from vllm_engine.bridge import Bridge
from vllm_engine.core_driver import CoreCallbacks, CoreDriver, refusal
from vllm_engine.events import BufferingPublisher

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerCore(CoreDriver):
    def __init__(self, llm: VllmLLMEngine, bridge: Bridge) -> None:
        super().__init__(llm.model_config.max_model_len, llm.model_config.get_vocab_size())
        core = llm.engine_core.engine_core  # the in-process client: the engine core itself
        self._llm, self._bridge = llm, bridge
        self._scheduler = core.scheduler
        self._pool = self._scheduler.kv_cache_manager.block_pool
        self._publisher = BufferingPublisher()
        self._scheduler.kv_event_publisher = self._publisher
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._step_thread = step_executor()  # steps never wait for a shared pool's thread
        self._callbacks: CoreCallbacks | None = None

    def start(self, callbacks: CoreCallbacks) -> None:
        self._callbacks = callbacks
        loop = asyncio.get_running_loop()

        def wake() -> None:  # a report (a lease ended, a pull stopped) is work for a step
            loop.call_soon_threadsafe(self._wakeup.set)

        self._bridge.on_report = wake
        self._task = asyncio.create_task(
            run_until_dead(self._iterate, callbacks.die), name="vllm-engine-loop"
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._step_thread.shutdown(wait=False)

    async def call(self, fn: Callable[[], T]) -> T:
        async with self._lock:
            try:
                return fn()
            finally:
                self._refresh()
                self._wakeup.set()

    def add(self, rid: str, prompt_token_ids: list[int], params: VllmParams) -> None:
        try:
            self._llm.add_request(rid, {"prompt_token_ids": prompt_token_ids}, params)
        except (ValueError, TypeError, VLLMClientError) as exc:  # its input checks
            self._llm.abort_request([rid])  # whatever of it vLLM registered before refusing
            raise refusal(rid, exc) from exc

    def abort(self, rids: list[str]) -> None:
        self._llm.abort_request(rids)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_gpu_blocks - 1  # block 0 is vLLM's null block

    def counts(self) -> tuple[int, int]:
        running, waiting = self._scheduler.get_request_counts()
        return running, waiting

    def num_free_blocks(self) -> int:
        return int(self._pool.get_num_free_blocks())

    def take_event_batches(self) -> list[EventBatch]:
        return self._publisher.take()

    # ---- the loop ---------------------------------------------------------------------------
    def _has_work(self) -> bool:
        running, waiting = self.counts()
        return running + waiting > self._bridge.num_loading or self._bridge.has_reports()

    async def _iterate(self) -> None:
        assert self._callbacks is not None
        await self._wakeup.wait()
        self.progress.working()
        async with self._lock:
            if not self._has_work():
                self._wakeup.clear()
                self.progress.progressed(stepped=False)
                return
            events = self._bridge.events
            outputs = await finish_in_thread(self._llm.step, executor=self._step_thread)
            self._callbacks.deliver([o for o in outputs if isinstance(o, RequestOutput)])
            # Only once its outputs are delivered has a step completed: a delivery that
            # hangs or fails must not pass for progress (the stall clock, /livez).
            self.progress.progressed(stepped=True)
            self._refresh()
            idle = not outputs and not self._scheduler.running
            if idle and events == self._bridge.events and not self._bridge.has_reports():
                # Nothing could be scheduled, nothing moved: wait for a call to change that.
                self._wakeup.clear()

    def _refresh(self) -> None:
        if self._callbacks is not None:
            self._callbacks.refresh()
