"""`pdserve bench` against real local clusters (disaggregated, and the colocated baseline):
it completes, measures, and writes results.json and PNG plots that open."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PIL import Image

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, router_pb2
from tests.integration.cluster_util import generate_many, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def colocated(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=0,
        num_decode=2,
        colocated=True,
        log_dir=tmp_path_factory.mktemp("colocated-logs"),
    )
    with LocalCluster(config) as cluster:
        yield cluster


def _bench(router: str, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "app",
        "bench",
        "--router",
        router,
        "--out",
        str(out),
    ]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=300)


def _check_outputs(out: Path, num_requests: int, ttft_phases: set[str]) -> dict[str, object]:
    results = json.loads((out / "results.json").read_text())  # strict JSON: no NaN
    summary = results["summary"]
    assert summary["num_completed"] == num_requests and summary["num_failed"] == 0
    assert len(results["requests"]) == num_requests
    for request in results["requests"]:
        assert 0 < request["ttft_s"] <= request["e2e_s"]
        # The router's phases before the first token: its TTFT, within the client's.
        router_ttft = sum(request["phases_s"][p] for p in ttft_phases)
        assert 0 < router_ttft <= request["ttft_s"]
    assert ttft_phases <= set(summary["phases_s"])
    for distribution in summary["phases_s"].values():
        assert 0 <= distribution["p50"] <= distribution["p90"]
    for name in ("latency_cdf.png", "latency_over_time.png", "phases.png"):
        with Image.open(out / name) as image:
            image.verify()  # a complete, decodable PNG
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size[0] > 300
    return summary  # type: ignore[no-any-return]


def test_closed_loop_bench_on_a_disaggregated_cluster(llama_dir: Path, tmp_path: Path) -> None:
    config = ClusterConfig(
        model=str(llama_dir), log_dir=tmp_path, router_args=("--local-prefill-tokens", "0")
    )
    with LocalCluster(config) as cluster:
        done = _bench(
            cluster.address, tmp_path / "out", "--workload", "synthetic", "--concurrency", "2",
            "--num-requests", "6", "--input-len", "24", "--output-len", "6",
            "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "goodput" in done.stdout and "6/6 requests" in done.stderr
    assert "prefill_compute" in done.stdout and "kv_transfer" in done.stdout  # the phase table
    summary = _check_outputs(
        tmp_path / "out", 6, {"router", "route", "prefill_queue", "prefill_compute", "prefill_rpc"}
    )
    assert summary["slo_fraction"] == 1.0
    assert summary["output_token_throughput"] > 0


def test_colocated_cluster_matches_one_engine_and_takes_open_loop_load(
    colocated: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    assert not colocated.prefill  # no prefill pool at all
    prompts = [[5 + i] * (12 + 7 * i) for i in range(4)]
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    requests = [router_pb2.GenerateRequest(prompt_token_ids=p, sampling=sampling) for p in prompts]
    results = run(generate_many(colocated.address, requests))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = make_llm(llama_dir).generate(prompts, params)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert all(r.transfer_s == 0 for r in results)  # nothing moved between workers

    done = _bench(
        colocated.address, tmp_path / "out", "--workload", "shared-prefix", "--rate", "20",
        "--num-requests", "8", "--input-len", "32", "--output-len", "4", "--seed", "3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    _check_outputs(tmp_path / "out", 8, {"router", "route", "local_prefill"})
    router = colocated.router
    assert router is not None
    with urllib.request.urlopen(f"http://{router.metrics_address}/metrics") as reply:
        metrics = reply.read().decode()
    assert (
        'pdserve_routing_decisions_total{policy="colocated",pool="decode",reason="colocated"}'
        in metrics
    )
