"""Threads for blocking work, kept apart by what they serve, and run from asyncio without
losing track of them on cancellation.

asyncio's default executor is shared by everything in a process (``asyncio.to_thread``);
blocking transfer I/O (NIXL READs, digests, KV encoding) once filled it and left the engine
step no thread, so a worker answered but made no progress. Now:
- each engine's loop runs its steps on a thread of its own (``step_executor``: one, named
  ``engine-step``; steps never overlap), where the engine is built as well;
- transfer I/O runs on ``transfer_executor()`` (``TRANSFER_THREADS``, named ``kv-transfer``),
  shared by a process's KV senders and receivers;
- the default executor serves the rest (loading, handshakes).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Concurrent blocking transfer calls per process: pulls beyond it queue (each one's deadline
# is checked when it starts, kvtransfer/nixl_agent.py).
TRANSFER_THREADS = 8

_transfer: ThreadPoolExecutor | None = None
_transfer_lock = threading.Lock()


def step_executor() -> ThreadPoolExecutor:
    """A thread for one engine's steps (its owner shuts it down when the engine closes).

    Build the engine on it too (``finish_in_thread(build, executor=...)``): libgomp keeps a
    team of OpenMP threads for every thread that ran a parallel region, and once a process
    has more of them than CPUs it stops spinning between regions, so each of a step's
    hundreds of parallel kernels first waits for its threads to wake (a served decode step
    took 65 ms against 45 on the engine's own thread, measured on 2 cores)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")


def transfer_executor() -> ThreadPoolExecutor:
    """The process's threads for blocking KV transfer I/O."""
    global _transfer
    with _transfer_lock:
        if _transfer is None:
            _transfer = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="kv-transfer")
        return _transfer


async def finish_in_thread(
    fn: Callable[..., T], *args: object, executor: Executor | None = None
) -> T:
    """``fn(*args)`` on ``executor`` (None: the default one) that, if cancelled, waits for the
    thread to finish before re-raising. A cancelled ``to_thread`` returns at once while the
    thread keeps running; callers that free or reuse what the thread touches (KV blocks,
    engine state) must not do that."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(executor, functools.partial(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise
