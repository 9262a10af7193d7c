"""The serving-engine contract (``serving_engine_suite.py``) on the native engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.serving_engine import EngineHooks
from native_engine.builder import build_native_engine
from tests.contract.serving_engine_suite import CASES, Case


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_native_engine_keeps_the_contract(case: Case, model_factory: Callable[..., Path]) -> None:
    config = EngineConfig(
        model=str(model_factory("llama")), cache=CacheConfig(block_size=16, num_blocks=24)
    )

    async def run() -> None:
        engine = await build_native_engine(config, EngineHooks())
        engine.start()
        try:
            await case(engine, list(range(40, 80)))
        finally:
            await engine.close()

    asyncio.run(run())
