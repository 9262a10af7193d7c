"""Builds the vLLM engine for a worker service (an ``EngineBuilder``, given by
``pdserve.app.components``): vLLM's engine core in this process, with pdserve's connector, sampler
and event publisher plugged in (``vllm_engine.args``)."""

from __future__ import annotations

import asyncio
import os

from engine.block_hash import root_hash
from engine.checkpoint import CheckpointInfo
from engine.config import EngineBackend, EngineConfig
from engine.fingerprint import engine_fingerprint
from engine.serving_engine import EngineHooks
from engine.tokenizer import Tokenizer
from vllm_engine.args import engine_args
from vllm_engine.bridge import Bridge
from vllm_engine.engine import VllmEngine
from vllm_engine.install import require_vllm


async def build_vllm_engine(config: EngineConfig, hooks: EngineHooks) -> VllmEngine:
    """Loads vLLM and the model in a thread (tens of seconds); the engine is not started."""
    version = require_vllm()
    fingerprint = await asyncio.to_thread(
        engine_fingerprint,
        config.model,
        EngineBackend.VLLM,
        config.dtype,
        config.cache.block_size,
        config.cache.kv_cache_dtype,
    )
    bridge = Bridge(asyncio.get_running_loop(), fingerprint, version)
    try:
        return await asyncio.to_thread(_load, config, hooks, bridge)
    except BaseException:
        bridge.close()
        raise


def _load(config: EngineConfig, hooks: EngineHooks, bridge: Bridge) -> VllmEngine:
    # vLLM's engine core must run in this process, where the connector reaches the bridge
    # (vLLM reads this switch from the environment only).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_engine.events import CachedBlocks

    args = engine_args(config, bridge.id, on_cpu=current_platform.is_cpu())
    llm = LLMEngine.from_engine_args(EngineArgs(**args))
    return VllmEngine(
        llm,
        bridge,
        config,
        hooks,
        checkpoint=CheckpointInfo.from_dir(config.model),
        tokenizer=Tokenizer.from_dir(config.model),
        fingerprint=bridge.fingerprint,
        max_model_len=llm.model_config.max_model_len,
        cached=CachedBlocks(root_hash(bridge.fingerprint)),
    )
