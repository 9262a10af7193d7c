"""pdserve engine: paged-KV decoder-only Transformer (no grpc/ray/redis imports).

The public names load lazily so that torch-free modules (``engine.block_hash``, the scheduler,
the block manager) can be imported by the router without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "CacheConfig": "engine.config",
    "EngineConfig": "engine.config",
    "SchedulerConfig": "engine.config",
    "EngineStats": "engine.outputs",
    "PrefilledRequest": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "RequestUpdate": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

if TYPE_CHECKING:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import EngineStats, PrefilledRequest, RequestOutput, RequestUpdate
    from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "PrefilledRequest",
    "RequestOutput",
    "RequestUpdate",
    "SamplingParams",
    "SchedulerConfig",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
