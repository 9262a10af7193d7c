"""The serving-engine contract (``tests/contract/serving_engine_suite.py``) on the vLLM engine,
built in this process as a worker builds it (one vLLM engine: its connector is per process)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineBackend, EngineConfig, VllmOptions
from engine.serving_engine import EngineHooks
from tests.contract.serving_engine_suite import CASES, Case
from tests.vllm.conftest import BLOCK_SIZE
from vllm_engine.builder import build_vllm_engine
from vllm_engine.engine import VllmEngine


@pytest.fixture(scope="module")
def loop_and_engine(
    vllm_model: Callable[[str], Path],
) -> Iterator[tuple[asyncio.AbstractEventLoop, VllmEngine]]:
    config = EngineConfig(
        model=str(vllm_model("llama")),
        backend=EngineBackend.VLLM,
        max_model_len=512,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=24),
        vllm=VllmOptions(enforce_eager=True),
    )

    async def started() -> VllmEngine:
        engine = await build_vllm_engine(config, EngineHooks())
        engine.start()
        return engine

    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(started())
    yield loop, engine
    loop.run_until_complete(engine.close())
    loop.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_vllm_engine_keeps_the_contract(
    case: Case, loop_and_engine: tuple[asyncio.AbstractEventLoop, VllmEngine]
) -> None:
    loop, engine = loop_and_engine
    assert engine.num_blocks == 24
    assert engine.kv_layout.page_layout.startswith("vllm-0.32.0/")
    loop.run_until_complete(case(engine, list(range(40, 110))))
