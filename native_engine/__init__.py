"""pdserve's native engine: a paged-KV decoder-only Transformer behind the engine contract
(``engine.serving_engine``): its loop (``async_engine``), scheduler, block manager, paged cache
and host tier, model runner, kernels, speculation, and the offline ``LLM``. It imports only the
contract (``engine``); ``kvtransfer`` and the component builder import it.

The public names load lazily: ``native_engine.scheduler`` and the block manager are torch-free
(the capacity planner runs them with no model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "native_engine.llm",
    "LLMEngine": "native_engine.llm_engine",
}

if TYPE_CHECKING:
    from native_engine.llm import LLM
    from native_engine.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'native_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
