"""One engine's step loop on the worker's event loop, for every engine that steps in the worker's
process (the native ``AsyncEngine``; the vLLM engine's ``WorkerCore``).

Engines are not thread-safe. Steps run in a thread of their own (``engine/threads.py``) so the
event loop keeps serving RPCs; every other call into the engine runs on the event loop while no
step is in flight (``call``: one lock, FIFO). The loop sleeps when there is no work, or when a
step could move nothing (no free blocks, everything paused): a call, or ``wake``, starts it
again. It marks its progress (``engine/step_progress.py``) for the worker's liveness, and ends,
telling ``die`` once, when anything escapes a step or a delivery (``run_until_dead``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.serving_engine import run_until_dead
from engine.step_progress import StepProgress
from engine.threads import finish_in_thread, step_executor

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class Stepping(Generic[R]):
    """What a ``StepLoop`` steps. All but ``step`` run on the event loop, under the loop's lock
    (``before_step``: outside it, so calls go on meanwhile)."""

    has_work: Callable[[], bool]
    step: Callable[[], R]  # in the loop's step thread
    # Hands the step's result to its consumers; True: the step could move nothing, so the
    # loop sleeps until a call or ``wake`` changes that instead of spinning.
    deliver: Callable[[R], bool]
    refresh: Callable[[], None]  # after every step and every call (stats, events)
    before_step: Callable[[], Awaitable[None]] | None = None


class StepLoop(Generic[R]):
    """Owned by one engine: ``start`` on its event loop, ``close`` when the engine closes."""

    def __init__(
        self,
        stepping: Stepping[R],
        name: str,
        progress: StepProgress,
        thread: ThreadPoolExecutor | None = None,
    ) -> None:
        """``thread``: the steps' thread (``step_executor``), when the engine was built on it;
        else a new one."""
        self._stepping = stepping
        self._name = name
        self.progress = progress  # only this loop writes it
        self.in_step = False  # a step runs: what fails now, fails in it
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Steps never wait for a shared pool's thread.
        self._thread = thread if thread is not None else step_executor()

    def start(self, die: Callable[[BaseException], None]) -> None:
        self._task = asyncio.create_task(run_until_dead(self._iterate, die), name=self._name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=False)

    async def call(self, fn: Callable[[], T], check: Callable[[], None] | None = None) -> T:
        """Runs a (fast) engine call between steps; what it freed or added may let a stalled
        loop move again. ``check`` runs first, under the lock (an engine that died while the
        call waited for it raises there, and nothing is refreshed)."""
        async with self._lock:
            if check is not None:
                check()
            try:
                return fn()
            finally:
                self._stepping.refresh()
                self._wakeup.set()

    def wake(self) -> None:
        """There may be work a call did not bring (event-loop thread only)."""
        self._wakeup.set()

    async def _iterate(self) -> None:
        stepping = self._stepping
        await self._wakeup.wait()
        self.progress.working()
        if stepping.before_step is not None:
            await stepping.before_step()
        async with self._lock:
            if not stepping.has_work():
                self._wakeup.clear()
                self.progress.progressed(stepped=False)
                return
            self.in_step = True
            result = await finish_in_thread(stepping.step, executor=self._thread)
            self.in_step = False
            idle = stepping.deliver(result)
            # Only once its result is delivered has a step completed: a delivery that hangs
            # or fails must not pass for progress (the stall clock, /livez).
            self.progress.progressed(stepped=True)
            stepping.refresh()
            if idle:
                self._wakeup.clear()
