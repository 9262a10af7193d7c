"""Builds the vLLM engine for a worker service (an ``EngineBuilder``, given by
``pdserve.app.components``): vLLM's engine core in this process, with pdserve's connector, sampler
and event publisher plugged in (``vllm_engine.args``); with tensor parallelism, the hub its
ranks dial first (``vllm_engine/rank_hub.py``)."""

from __future__ import annotations

import asyncio
import os

import setproctitle

from engine.block_hash import root_hash
from engine.checkpoint import CheckpointInfo
from engine.config import EngineBackend, EngineConfig
from engine.fingerprint import engine_fingerprint
from engine.serving_engine import EngineHooks
from engine.tokenizer import Tokenizer
from vllm_engine.args import ConnectorTarget, engine_args
from vllm_engine.bridge import Bridge
from vllm_engine.engine import VllmEngine
from vllm_engine.install import require_vllm
from vllm_engine.rank_hub import RankHub

# Loading the model in every rank, then profiling its memory, may take minutes on a busy box.
RANKS_READY_TIMEOUT_S = 60.0
V2_RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"


def check_model_runner(use_v2_model_runner: bool) -> None:
    """Refuses vLLM's Model Runner V2 by name: its logits processors are not pdserve's."""
    if use_v2_model_runner:
        raise ValueError(
            f"vLLM chose its Model Runner V2 ({V2_RUNNER_VARIABLE}="
            f"{os.environ.get(V2_RUNNER_VARIABLE, '')!r}, or a feature that needs it): "
            f"pdserve's sampler runs in the V1 model runner; unset {V2_RUNNER_VARIABLE} or "
            "set it to 0"
        )


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
    tp_size = config.vllm.tensor_parallel_size
    hub = RankHub(tp_size) if tp_size > 1 else None
    try:
        if hub is not None:
            await hub.start()
        hub_address = hub.address if hub else ""
        name = setproctitle.getproctitle()
        target = ConnectorTarget(bridge.id, fingerprint, version, hub_address, name)
        engine = await asyncio.to_thread(_load, config, hooks, bridge, target, hub)
        if hub is not None:  # each rank said hello while vLLM built it: this is a check
            await hub.wait_ranks(RANKS_READY_TIMEOUT_S)
        return engine
    except BaseException:
        bridge.close()
        if hub is not None:
            await hub.close()
        raise


def _load(
    config: EngineConfig,
    hooks: EngineHooks,
    bridge: Bridge,
    target: ConnectorTarget,
    hub: RankHub | None,
) -> VllmEngine:
    # vLLM's engine core must run in this process, where the connector reaches the bridge
    # (vLLM reads this switch from the environment only).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if hub is not None:
        # Ranks start fresh interpreters: a fork would copy this process's live gRPC threads.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if config.vllm.cpu_omp_threads_bind is not None:  # each rank's cores (CPU), as given
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.vllm.cpu_omp_threads_bind
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_engine.events import CachedBlocks

    # pdserve's sampler is a V1 logits processor (``vllm_engine/sampler.py``): Model Runner V2,
    # vLLM 0.32's default on CUDA, takes another interface. The V1 runner unless the operator
    # chose otherwise, and then a refusal by name before the model loads.
    os.environ.setdefault(V2_RUNNER_VARIABLE, "0")
    args = engine_args(config, target, on_cpu=current_platform.is_cpu())
    vllm_config = EngineArgs(**args).create_engine_config()
    check_model_runner(vllm_config.use_v2_model_runner)
    llm = LLMEngine.from_vllm_config(vllm_config, disable_log_stats=True)
    return VllmEngine(
        llm,
        bridge,
        hub,
        config,
        hooks,
        checkpoint=CheckpointInfo.from_dir(config.model),
        tokenizer=Tokenizer.from_dir(config.model),
        fingerprint=bridge.fingerprint,
        max_model_len=llm.model_config.max_model_len,
        cached=CachedBlocks(root_hash(bridge.fingerprint)),
    )
