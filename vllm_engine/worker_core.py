"""vLLM's engine core in the worker's process (``VllmEngineCore.WORKER``; the contract is
``vllm_engine/core_driver.py``).

It is stepped by the loop the native ``AsyncEngine`` is stepped by (``engine/step_loop.py``):
steps in a thread of their own, every other call into vLLM between steps. Its one rank runs
here too (``--engine-core worker`` is refused with tensor parallelism): both halves of the
connector reach the engine's ``Bridge`` in memory.

The vLLM internals this relies on (``docs/engines.md``, checked by
``tests/vllm/test_vllm_pieces.py``): the in-process engine core behind ``LLMEngine``, its
scheduler's request counts and block pool, and its KV event publisher, replaced by a buffer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from vllm import SamplingParams as VllmParams
from vllm.distributed.kv_events import EventBatch
from vllm.exceptions import VLLMClientError
from vllm.outputs import RequestOutput
from vllm.v1.engine.llm_engine import LLMEngine as VllmLLMEngine

from engine.step_loop import StepLoop, Stepping
from vllm_engine.bridge import Bridge
from vllm_engine.core_driver import CoreCallbacks, CoreDriver, refusal
from vllm_engine.events import BufferingPublisher

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerCore(CoreDriver):
    def __init__(
        self, llm: VllmLLMEngine, bridge: Bridge, step_thread: ThreadPoolExecutor | None = None
    ) -> None:
        """``step_thread``: the thread ``llm`` was loaded on, for its steps; else a new one."""
        super().__init__(llm.model_config.max_model_len, llm.model_config.get_vocab_size())
        core = llm.engine_core.engine_core  # the in-process client: the engine core itself
        self._llm, self._bridge = llm, bridge
        self._scheduler = core.scheduler
        self._pool = self._scheduler.kv_cache_manager.block_pool
        self._publisher = BufferingPublisher()
        self._scheduler.kv_event_publisher = self._publisher
        self._callbacks: CoreCallbacks | None = None
        self._events_before_step = 0
        stepping = Stepping(
            has_work=self._has_work, step=self._step, deliver=self._deliver, refresh=self._refresh
        )
        self._loop = StepLoop(stepping, "vllm-engine-loop", self.progress, step_thread)

    def start(self, callbacks: CoreCallbacks) -> None:
        self._callbacks = callbacks
        loop = asyncio.get_running_loop()

        def wake() -> None:  # a report (a lease ended, a pull stopped) is work for a step
            loop.call_soon_threadsafe(self._loop.wake)

        self._bridge.on_report = wake
        self._loop.start(callbacks.die)

    async def close(self) -> None:
        await self._loop.close()

    async def call(self, fn: Callable[[], T]) -> T:
        return await self._loop.call(fn)

    def add(self, rid: str, prompt_token_ids: list[int], params: VllmParams, priority: int) -> None:
        try:
            prompt = {"prompt_token_ids": prompt_token_ids}
            self._llm.add_request(rid, prompt, params, priority=priority)
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
    def _has_work(self) -> bool:  # right before a step, under the loop's lock
        self._events_before_step = self._bridge.events
        running, waiting = self.counts()
        return running + waiting > self._bridge.num_loading or self._bridge.has_reports()

    def _step(self) -> Seq[object]:  # in the loop's step thread
        return self._llm.step()

    def _deliver(self, outputs: Seq[object]) -> bool:
        """True: nothing could be scheduled and nothing moved (no report arrived meanwhile):
        the loop waits for a call to change that."""
        assert self._callbacks is not None
        self._callbacks.deliver([o for o in outputs if isinstance(o, RequestOutput)])
        idle = not outputs and not self._scheduler.running
        moved = self._events_before_step != self._bridge.events or self._bridge.has_reports()
        return idle and not moved

    def _refresh(self) -> None:
        if self._callbacks is not None:
            self._callbacks.refresh()
