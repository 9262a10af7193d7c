"""pdserve's engine contract and its vocabulary: what every engine serves (``serving_engine``:
``ServingEngine``, docs/engines.md), the data it speaks in (sampling parameters, outputs, KV
layout and pages, block hashes and events, the model's description), and the rules both
engines share (stop rules, the seeded choice, logits processing, grammars). No grpc, ray or
redis; the engines themselves are ``native_engine`` and ``vllm_engine``.

The public names load lazily so that torch-free modules (``engine.block_hash``, the sampling
parameters) can be imported by the router without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
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
    from engine.outputs import EngineStats, PrefilledRequest, RequestOutput, RequestUpdate
    from engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
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
