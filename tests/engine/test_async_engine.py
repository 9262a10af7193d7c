"""AsyncEngine: a reader that stops reading pauses its request at the buffer bound (blocks kept,
no seat) and resumes it when it reads again, with the same tokens as one run; a quiet request
yields heartbeats; services reach the engine only through its methods; a worker's engine is
built on the thread that steps it."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.serving_engine import EngineHooks
from native_engine import LLM
from native_engine.async_engine import AsyncEngine
from native_engine.builder import build_native_engine
from native_engine.llm_engine import LLMEngine
from tests.services.harness import wait_for

PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _engine(model: Path, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        )
    )


def test_an_unread_request_pauses_at_the_bound_and_resumes_exactly(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompt = list(range(30, 50))
    reference = make_llm(llama_dir).generate([prompt], PARAMS)[0].token_ids

    async def run() -> None:
        engine = AsyncEngine(_engine(llama_dir), max_buffered_tokens=4)
        engine.start()
        try:
            stream = engine.generate("r", prompt, PARAMS)
            tokens = (await anext(stream)).new_token_ids  # admitted; then nobody reads

            async def paused() -> bool:
                return engine.stats.num_paused == 1 and engine.stats.num_running == 0

            await wait_for(paused, 30.0, "the unread request is paused")
            assert engine.num_buffered_tokens == 4  # the bound, not more
            assert engine.stats.num_free_blocks < engine.stats.num_blocks  # blocks kept
            async for update in stream:
                tokens.extend(update.new_token_ids)
            assert tokens == reference
            assert engine.num_buffered_tokens == 0
        finally:
            await engine.close()

    asyncio.run(run())


def test_a_request_waiting_for_a_seat_sends_heartbeats(llama_dir: Path) -> None:
    async def run() -> None:
        engine = AsyncEngine(_engine(llama_dir, max_num_seqs=1), heartbeat_s=0.05)
        engine.start()
        try:
            # The first request holds the only seat for a few hundred steps.
            long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            hog = engine.generate("hog", list(range(10, 20)), long)
            await anext(hog)
            await wait_for(
                lambda: _true(engine.stats.num_running == 1), 30.0, "the first request runs"
            )
            quiet = engine.generate("quiet", list(range(60, 70)), PARAMS)
            first = await anext(quiet)
            assert first.new_token_ids == [] and first.finish_reason is None  # a heartbeat
            await hog.aclose()  # its reader leaves: it is aborted, the seat frees
            tokens = [t async for u in quiet for t in u.new_token_ids]
            assert len(tokens) == PARAMS.max_tokens
            assert engine.stats.num_free_blocks == engine.stats.num_blocks
        finally:
            await engine.close()

    asyncio.run(run())


async def _true(value: bool) -> bool:
    return value


def test_a_pause_past_max_pause_s_gives_its_blocks_back_and_resumes_exactly(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """A slow reader cannot hold KV: past ``max_pause_s`` its blocks go back (another request
    keeps the engine stepping), and when it reads again it is recomputed: same tokens."""
    slow_prompt, busy_prompt = list(range(30, 50)), list(range(60, 75))
    busy_params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    llm = make_llm(llama_dir)
    reference = llm.generate([slow_prompt], PARAMS)[0].token_ids
    busy_reference = llm.generate([busy_prompt], busy_params)[0].token_ids

    async def run() -> None:
        config = EngineConfig(
            model=str(llama_dir),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_pause_s=0.001),  # past it by the next step
        )
        engine = AsyncEngine(LLMEngine(config), max_buffered_tokens=4)
        engine.start()
        try:
            # Counted before the slow request starts: its pause may expire as soon as it is
            # paused (a loaded box can step in between), before the busy request arrives.
            held = engine.stats.num_preemptions
            slow = engine.generate("slow", slow_prompt, PARAMS)
            tokens = (await anext(slow)).new_token_ids  # then nobody reads

            async def paused() -> bool:
                return engine.stats.num_paused == 1

            await wait_for(paused, 30.0, "the unread request is paused")
            busy_tokens: list[int] = []
            async for update in engine.generate("busy", busy_prompt, busy_params):
                busy_tokens.extend(update.new_token_ids)  # steps, past the pause bound
            assert busy_tokens == busy_reference
            assert engine.stats.num_preemptions == held + 1  # the pause gave its blocks back
            async for update in slow:
                tokens.extend(update.new_token_ids)
            assert tokens == reference  # recomputed, exactly
        finally:
            await engine.close()

    asyncio.run(run())


def _native_threads() -> int:
    """The process's threads Python does not know of: here, OpenMP's."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no OpenMP team to count")
def test_a_workers_engine_is_built_on_its_step_thread(model_factory: Callable[..., Path]) -> None:
    """Loading runs torch's parallel kernels too: built on any other thread, the process would
    keep a second OpenMP team, and with more OpenMP threads than CPUs libgomp stops spinning
    between parallel regions (a served step took 1.5x as long; engine/threads.py)."""
    model = model_factory("llama", "tiny64")

    async def run() -> None:
        before = _native_threads()
        config = EngineConfig(model=str(model), dtype="bfloat16", cache=CacheConfig(num_blocks=64))
        engine = await build_native_engine(config, EngineHooks())
        engine.start()
        try:
            stream = engine.generate("r", list(range(10, 40)), PARAMS)
            tokens = [t async for u in stream for t in u.new_token_ids]
            assert len(tokens) == PARAMS.max_tokens
            # One new team: its num_threads - 1 workers, and at most one other native thread.
            assert _native_threads() - before <= torch.get_num_threads()
        finally:
            await engine.close()

    asyncio.run(run())
