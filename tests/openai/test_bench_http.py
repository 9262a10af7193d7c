"""`pdserve bench --http` drives the same workloads through the OpenAI API: every request
completes with exactly its output length, counted from the token ids it streamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from tests.openai.conftest import API_KEY

pytestmark = pytest.mark.slow


def test_bench_through_the_openai_api(http_cluster: LocalCluster, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "app", "bench", "--http", http_cluster.http_url,
        "--workload", "synthetic", "--concurrency", "2", "--num-requests", "4",
        "--input-len", "20", "--output-len", "5", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PDSERVE_API_KEY": API_KEY}  # the key from the environment, not argv
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["summary"]["num_completed"] == 4
    assert "api_key" not in results["config"]
    for request in results["requests"]:
        assert request["num_output_tokens"] == 5 and request["num_prompt_tokens"] == 20
        assert 0 < request["ttft_s"] <= request["e2e_s"]


def test_bench_refuses_a_v1_url_and_both_frontends(http_cluster: LocalCluster) -> None:
    base = [sys.executable, "-m", "app", "bench", "--concurrency", "1"]
    with_v1 = subprocess.run(
        [*base, "--http", f"{http_cluster.http_url}/v1"], capture_output=True, text=True, timeout=60
    )
    assert with_v1.returncode == 2 and "without /v1" in with_v1.stderr
    both = subprocess.run(
        [*base, "--http", http_cluster.http_url, "--router", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
