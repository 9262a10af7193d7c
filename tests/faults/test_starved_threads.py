"""A worker process whose shared thread pools are full (blocked transfer I/O, slow digests)
still steps its engine: the step runs on a thread of its own (``engine/threads.py``). Before,
the step shared asyncio's default executor with blocking transfer calls, and ~32 slow pulls
left it no thread: the worker answered and heartbeated but produced nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.threads import TRANSFER_THREADS, transfer_executor
from native_engine import LLM
from native_engine.async_engine import AsyncEngine
from native_engine.llm_engine import LLMEngine

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("pool", ["default", "transfer"])
def test_the_engine_steps_while_every_shared_thread_is_blocked(
    pool: str, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompt = list(range(40, 60))
    reference = make_llm(llama_dir).generate([prompt], PARAMS)[0].token_ids
    release = threading.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        executor: Executor | None = transfer_executor() if pool == "transfer" else None
        # More blocked calls than the pool has threads (the default one: min(32, cpus + 4)).
        blocked = [loop.run_in_executor(executor, release.wait) for _ in range(40)]
        config = EngineConfig(model=str(llama_dir), cache=CacheConfig(num_blocks=64))
        engine = AsyncEngine(LLMEngine(config))
        engine.start()
        tokens: list[int] = []

        async def consume() -> None:
            async for update in engine.generate("r", prompt, PARAMS):
                tokens.extend(update.new_token_ids)

        consumer = asyncio.ensure_future(consume())
        try:
            # Far beyond a tiny model's 24 steps; the threads are released either way, so a
            # starved step fails this test instead of hanging it.
            done, _ = await asyncio.wait({consumer}, timeout=120)
            starved = consumer not in done
        finally:
            release.set()
            await asyncio.gather(*blocked)
            await asyncio.gather(consumer, return_exceptions=True)
            await engine.close()
        assert not starved, "no engine step while the shared threads were blocked"
        assert tokens == reference
        assert engine.progress.num_steps >= len(reference)

    assert TRANSFER_THREADS < 40
    asyncio.run(run())
