"""Builds the vLLM engine for a worker service (an ``EngineBuilder``, given by
``app.components``): vLLM's engine core in this process (``WorkerCore``) or in one of its
own (``ProcessCore``, through vLLM's ``AsyncLLM``), with pdserve's connector, sampler and event
publisher plugged in (``vllm_engine.args``); when ranks or the engine core run in processes of
their own, the hub they dial first (``vllm_engine/rank_hub.py``)."""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import setproctitle

from engine.block_hash import root_hash
from engine.checkpoint import CheckpointInfo
from engine.config import EngineConfig, VllmEngineCore
from engine.fingerprint import engine_fingerprint
from engine.model_layout import ModelLayout
from engine.serving_engine import EngineHooks
from engine.threads import finish_in_thread, step_executor
from engine.tokenizer import Tokenizer
from vllm_engine.args import ConnectorTarget, engine_args, engine_core_for
from vllm_engine.bridge import Bridge
from vllm_engine.core_driver import CoreDriver
from vllm_engine.engine import VllmEngine
from vllm_engine.install import require_vllm
from vllm_engine.rank_hub import RankHub

logger = logging.getLogger(__name__)
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
    layout = ModelLayout.of_engine(config)
    fingerprint = await asyncio.to_thread(engine_fingerprint, config.model, layout)
    bridge = Bridge(asyncio.get_running_loop(), fingerprint, version)
    tp_size = config.vllm.tensor_parallel_size
    mode = engine_core_for(config.vllm, on_cpu=await asyncio.to_thread(_on_cpu))
    logger.info("vLLM's engine core runs %s", _WHERE[mode])
    in_process = mode is VllmEngineCore.WORKER
    hub = None if in_process else RankHub(tp_size, bridge)
    try:
        if hub is not None:
            await hub.start()
        hub_address = hub.address if hub else ""
        name = setproctitle.getproctitle()
        bridge_id = bridge.id if in_process else ""
        target = ConnectorTarget(bridge_id, fingerprint, version, hub_address, name)
        if hub is None:
            # Loaded on the thread that will step it: one OpenMP team (engine/threads.py).
            thread = step_executor()
            try:
                core: CoreDriver = await finish_in_thread(
                    _load_in_worker, config, bridge, target, thread, executor=thread
                )
            except BaseException:
                thread.shutdown(wait=False)
                raise
        else:
            core = await _start_process(config, bridge, target, hub)
        if hub is not None:  # each rank said hello while vLLM built it: this is a check
            await hub.wait_ranks(RANKS_READY_TIMEOUT_S)
        return await asyncio.to_thread(_engine, config, hooks, core, bridge, hub)
    except BaseException:
        bridge.close()
        if hub is not None:
            await hub.close()
        raise


def _engine(
    config: EngineConfig,
    hooks: EngineHooks,
    core: CoreDriver,
    bridge: Bridge,
    hub: RankHub | None,
) -> VllmEngine:
    from vllm_engine.events import CachedBlocks

    checkpoint = CheckpointInfo.from_dir(config.model)
    return VllmEngine(
        core,
        bridge,
        hub,
        config,
        hooks,
        checkpoint=checkpoint,
        tokenizer=Tokenizer.from_dir(config.model),
        fingerprint=bridge.fingerprint,
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        cached=CachedBlocks(root_hash(bridge.fingerprint)),
    )


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


_WHERE = {
    VllmEngineCore.WORKER: "in the worker's process (--engine-core worker)",
    VllmEngineCore.PROCESS: "in a process of its own (--engine-core process)",
}


def _set_environment(config: EngineConfig) -> None:
    """vLLM reads these switches from the environment only."""
    # vLLM's processes start fresh interpreters: a fork would copy this process's live gRPC
    # threads.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if config.vllm.cpu_omp_threads_bind is not None:  # each rank's cores (CPU), as given
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.vllm.cpu_omp_threads_bind
    # pdserve's sampler is a V1 logits processor (``vllm_engine/sampler.py``): Model Runner V2,
    # vLLM 0.32's default on CUDA, takes another interface. The V1 runner unless the operator
    # chose otherwise, and then a refusal by name before the model loads.
    os.environ.setdefault(V2_RUNNER_VARIABLE, "0")


def _vllm_config(config: EngineConfig, target: ConnectorTarget, events_endpoint: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    args = engine_args(config, target, on_cpu=current_platform.is_cpu(), events=events_endpoint)
    vllm_config = EngineArgs(**args).create_engine_config()
    check_model_runner(vllm_config.use_v2_model_runner)
    return vllm_config


def _load_in_worker(
    config: EngineConfig, bridge: Bridge, target: ConnectorTarget, thread: ThreadPoolExecutor
) -> CoreDriver:
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_engine.worker_core import WorkerCore

    # The engine core and its one rank run here, where the connector reaches the bridge.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    _set_environment(config)
    llm = LLMEngine.from_vllm_config(_vllm_config(config, target, ""), disable_log_stats=True)
    return WorkerCore(llm, bridge, thread)


async def _start_process(
    config: EngineConfig, bridge: Bridge, target: ConnectorTarget, hub: RankHub
) -> CoreDriver:
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_engine.events import EventSubscriber
    from vllm_engine.process_core import CoreStats, ProcessCore

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    _set_environment(config)
    endpoint = f"ipc://{hub.socket_dir}/kv-events"
    events = EventSubscriber(endpoint)  # connected before vLLM binds: no event is missed
    stats: list[CoreStats] = []

    def stat_logger(vllm_config: Any, engine_index: int) -> CoreStats:
        stats.append(CoreStats(vllm_config, engine_index))
        return stats[-1]

    try:
        vllm_config = await asyncio.to_thread(_vllm_config, config, target, endpoint)
        # The engine core's start (the model's load, in its process) blocks this thread.
        llm = await asyncio.to_thread(
            AsyncLLM.from_vllm_config,
            vllm_config,
            stat_loggers=[stat_logger],
            disable_log_stats=False,
        )
    except BaseException:
        events.close()
        raise
    return ProcessCore(llm, bridge, hub, stats[0], events)
