"""A real local cluster with the OpenAI HTTP API on (and an API key), shared by the module's
tests, and the reference engine its outputs are compared with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from native_engine import LLM

API_KEY = "sk-test-openai"
MODEL_NAME = "tiny-chat"


@pytest.fixture(scope="module")
def http_cluster(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(API_KEY + "\n")
    config = ClusterConfig(
        model=str(llama_dir),
        router_http_port=0,
        log_dir=tmp_path_factory.mktemp("logs"),
        # Disaggregated for every prompt: both workers hold (and must free) each request.
        router_args=(
            "--local-prefill-tokens", "0",
            "--api-key-file", str(keys),
            "--served-model-name", MODEL_NAME,
        ),
    )  # fmt: skip
    with LocalCluster(config) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir))
