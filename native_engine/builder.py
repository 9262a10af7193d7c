"""The native engine for a worker service (an ``EngineBuilder``, ``engine/serving_engine.py``):
an ``LLMEngine`` built on the thread that will step it, wrapped in an ``AsyncEngine``."""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig
from engine.fault_injection import FaultInjection
from engine.serving_engine import EngineHooks
from engine.threads import finish_in_thread, step_executor
from native_engine.async_engine import AsyncEngine
from native_engine.llm_engine import LLMEngine


async def build_native_engine(config: EngineConfig, hooks: EngineHooks) -> AsyncEngine:
    """The native engine for a worker service (an ``EngineBuilder``): loads in a thread. Sets
    the process's torch threads (``EngineConfig.num_threads``; by default the CPUs this process
    may run on): one engine per worker process."""
    torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
    # Built on the thread that will step it: torch's parallel kernels then keep one OpenMP
    # team in this process (engine/threads.py, ``step_executor``).
    thread = step_executor()
    try:
        engine = await finish_in_thread(LLMEngine, config, executor=thread)
        # Guided decoding's token table, before the worker is ready: building it holds the
        # GIL (~0.3 s), which would stall the first guided request's process mid-serving.
        await finish_in_thread(engine.loaded.guides.warm, executor=thread)
    except BaseException:
        thread.shutdown(wait=False)
        raise
    return AsyncEngine(
        engine,
        on_stats=hooks.on_stats,
        on_dead=hooks.on_dead,
        max_buffered_tokens=hooks.max_buffered_tokens,
        heartbeat_s=hooks.heartbeat_s,
        faults=FaultInjection(config.fault_stall_at_step, config.fault_raise_on_token),
        step_thread=thread,
    )
