"""pdserve engine: paged-KV decoder-only Transformer (no grpc/ray/redis imports)."""

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
