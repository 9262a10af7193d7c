"""Fixtures for the vLLM engine's tests (run by `make test-vllm` in .venv-vllm): tiny random
checkpoints vLLM's CPU build can run (head_dim 64), the worker flags that keep each vLLM worker
small, and clusters of real processes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine.config import DEFAULT_BLOCK_SIZES, EngineBackend

# vLLM's CPU attention: block_size a multiple of 32, the vllm engine's default block size (no
# --block-size flag: every cluster here starts on the default). A small KV budget per worker (the
# box runs several), no torch.compile (seconds per start, nothing to gain on tiny models).
BLOCK_SIZE = DEFAULT_BLOCK_SIZES[EngineBackend.VLLM]
LAYOUT_ARGS = ("--engine", "vllm", "--dtype", "float32")
WORKER_ARGS = (*LAYOUT_ARGS, "--kv-cache-bytes", str(32 << 20), "--enforce-eager")
WORKER_ARGS += ("--max-model-len", "512")


@pytest.fixture(scope="session")
def vllm_model(model_factory: Callable[..., Path]) -> Callable[[str], Path]:
    """``vllm_model("llama" | "qwen3_moe" | "mixtral")``: a tiny64 checkpoint."""

    def build(arch: str) -> Path:
        return model_factory(arch, size="tiny64")

    return build


@contextmanager
def vllm_cluster(
    model: Path,
    redis_url: str,
    log_dir: Path,
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    colocated: bool = False,
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    router_args: tuple[str, ...] = (),
    http: bool = False,
    max_restarts: int | None = None,
) -> Iterator[LocalCluster]:
    """`pdserve up --engine vllm`, every stream disaggregated unless colocated."""
    config = ClusterConfig(
        model=str(model),
        num_prefill=0 if colocated else num_prefill,
        num_decode=num_decode,
        redis_url=redis_url,
        redis_namespace=log_dir.name,
        log_dir=log_dir,
        colocated=colocated,
        router_http_port=0 if http else None,
        prefill_args=(*WORKER_ARGS, *prefill_args),
        decode_args=(*WORKER_ARGS, *decode_args),
        router_args=(*LAYOUT_ARGS, "--local-prefill-tokens", "0", *router_args),
    )
    if max_restarts is not None:
        config = dataclasses.replace(config, max_restarts=max_restarts)
    with LocalCluster(config) as cluster:
        yield cluster
