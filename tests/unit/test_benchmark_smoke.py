"""The engine benchmark runs end to end (numbers are for benchmarks/, not for tests)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quick_run(script: str, model_dir: Path, *flags: str) -> dict[str, Any]:
    """Runs ``benchmarks/<script> --quick`` and returns its final JSON line."""
    command = [sys.executable, f"benchmarks/{script}", "--quick", "--model", str(model_dir)]
    result = subprocess.run(
        [*command, *flags], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.slow
def test_engine_decode_benchmark_quick_run_emits_a_json_report(tmp_path: Path) -> None:
    report = quick_run("engine_decode.py", tmp_path / "bench-model")
    assert [r["batch"] for r in report["decode"]] == [1, 2]
    for row in report["decode"]:
        assert row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["roofline_tok_s"] > 0
        assert row["greedy_match"] == 1.0  # engine and HF agree on the benchmark prompts too
    assert report["prefill"]["engine_tok_s"] > 0


def test_small_gemm_benchmark_times_every_kernel_against_the_copy_bandwidth() -> None:
    command = [sys.executable, "benchmarks/small_gemm.py", "--quick"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["copy_gb_s"] > 0 and "AVX2" in report["kernels"]
    assert report["chosen"] in report["kernels"]
    assert [row["m"] for row in report["model"]] == [1, 8]
    for row in report["model"]:
        assert all(gb_s > 0 for gb_s in row["gb_s"].values())


@pytest.mark.slow
def test_decode_attention_benchmark_quick_run_checks_and_times_both_paths() -> None:
    command = [sys.executable, "benchmarks/decode_attention.py", "--quick"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (case,) = json.loads(result.stdout.strip().splitlines()[-1])["cases"]
    assert case["kernel_us"] > 0 and case["torch_us"] > 0  # after agreeing on the output


@pytest.mark.slow
def test_kv_transfer_benchmark_quick_run_emits_a_json_report(tmp_path: Path) -> None:
    # Without the Ray rows (their own local Ray: 15 s; the Ray backend has its tests).
    flags = ("--mib", "8", "--repeats", "1", "--skip-ray")
    report = quick_run("kv_transfer.py", tmp_path / "bench-model", *flags)
    transport = report["transport"]
    assert transport["verified"] is True  # the gRPC path delivered the sender's exact bytes
    assert transport["bytes"] == 8 << 20
    assert transport["grpc_gb_s"] > 0 and transport["raw_tcp_gb_s"] > 0
    assert report["grpc_over_raw"] == transport["grpc_over_raw"] > 0
    ttft = report["ttft"]
    assert ttft["ttft_s"] > 0 and ttft["compute_s"] > 0 and ttft["transfer_s"] > 0
    assert report["transfer_over_ttft"] == ttft["transfer_over_ttft"] > 0
    assert ttft["cached_tokens"] == [0] * ttft["repeats"]  # fresh prompts: no prefix-cache hits
    # NIXL (a dev dependency): read into place, byte-checked, both verification settings.
    nixl = report["nixl"]
    assert nixl["verified"] is True and nixl["bytes"] == 8 << 20
    assert report["nixl_gb_s"] == nixl["nixl_gb_s"] > 0 and report["nixl_verify_gb_s"] > 0
    assert report["nixl_over_raw"] > 0 and report["nixl_over_grpc"] > 0
    assert report["ucx_transports"] and "unknown" not in report["ucx_transports"]
    assert report["ttft_nixl"]["backend"] == "nixl" and report["ttft_nixl"]["transfer_s"] > 0
    assert report["ray"] is None


@pytest.mark.slow
def test_prefix_routing_benchmark_quick_run_emits_a_json_report(tmp_path: Path) -> None:
    report = quick_run("prefix_routing.py", tmp_path / "bench-model")
    by_policy = {run["policy"]: run for run in report["runs"]}
    assert set(by_policy) == {"cache_aware", "round_robin"}
    for run in by_policy.values():
        assert run["requests"] == 12 and run["prefill_tokens"] >= run["ideal_tokens"]
        assert run["ttft_p50_s"] > 0
    assert report["cache_aware_over_ideal"] == by_policy["cache_aware"]["over_ideal"]
    lookup = report["index_lookup"]
    assert lookup["prefix_hits_s"] > 0 and lookup["two_lookups_s"] > 0
    assert lookup["ratio"] == lookup["prefix_hits_s"] / lookup["two_lookups_s"]


@pytest.mark.slow
def test_disagg_vs_colocated_quick_run_writes_table_and_plot(tmp_path: Path) -> None:
    out = str(tmp_path / "docs")
    report = quick_run("disagg_vs_colocated.py", tmp_path / "bench-model", "--out", out)
    assert {(r["mode"], r["rate"]) for r in report["rows"]} == {
        ("colocated", 4.0),
        ("disaggregated", 4.0),
        ("planned", 4.0),  # what pdserve plan recommends, from this machine's profile
    }
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in report["rows"])
    assert len(report["plan_candidates"]) == 6  # 1P:1D, 1P:2D, 2P:1D, colocated x1..3
    planned = next(r for r in report["rows"] if r["mode"] == "planned")
    assert planned["config"] in {c["label"] for c in report["plan_candidates"]}
    table = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "| colocated | colocated x2 | 4 |" in table and "| disaggregated | 1P:1D | 4 |" in table
    assert f"| planned | {planned['config']} | 4 |" in table
    # The phase table: disaggregated requests prefill on the prefill worker, colocated ones
    # on the worker that decodes them.
    disaggregated = next(r for r in report["rows"] if r["mode"] == "disaggregated")
    colocated = next(r for r in report["rows"] if r["mode"] == "colocated")
    assert {"prefill_queue", "prefill_compute", "kv_transfer"} <= set(disaggregated["phases_ms"])
    assert "local_prefill" in colocated["phases_ms"]
    assert "| prefill_compute |" in table
    assert (tmp_path / "docs" / "benchmarks" / "disagg_vs_colocated.png").stat().st_size > 0


@pytest.mark.slow
def test_chaos_smoke_run_loses_nothing_under_faults(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/chaos.py", "--smoke", "--model", str(tmp_path / "m")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "chaos" and report["stall_timeout_s"] == 30.0  # the default
    faults = report["mixed"]["faults"]
    assert len(faults) == 3 and not any("not detected" in f for f in faults), faults
    for run in (report["mixed"], report["baseline"]):
        assert run["failed"] == run["hung"] == run["leaked_blocks"] == 0
        assert run["completed_identical"] + run["completed_near_tie"] == run["requests"] == 24
    # Whether a fault hits a stream depends on timing; the baseline has none to hit.
    assert report["baseline"]["migrations"] == 0


@pytest.mark.slow
def test_frontends_quick_run_serves_both_apis(tmp_path: Path) -> None:
    report = quick_run("frontends.py", tmp_path / "bench-model")
    assert set(report["rows"]) == {"grpc", "http"}
    for row in report["rows"].values():
        assert row["completed"] == 24 and row["failed"] == 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["router_cpu_ms_per_request"] > 0
    grpc, http = report["rows"]["grpc"], report["rows"]["http"]
    assert report["http_added_ttft_p50_ms"] == http["ttft_p50_ms"] - grpc["ttft_p50_ms"]


@pytest.mark.slow
def test_planner_accuracy_smoke_run_compares_the_simulator_with_a_real_run(
    tmp_path: Path,
) -> None:
    report = quick_run("planner_accuracy.py", tmp_path / "bench-model", "--smoke")
    assert report["benchmark"] == "planner_accuracy"
    (row,) = report["rows"]
    assert row["config"] == "1P:1D" and row["rate"] == 2.0
    for side in ("real", "sim"):
        assert row[side]["ttft_p90"] > 0 and row[side]["tpot_p90"] > 0 and row[side]["goodput"] > 0
    assert report["max_rel_error"] == max(row["rel_error"].values())
    assert report["repeats"] == 2 and len(row["runs"]) == 2  # every real run repeated
    for metric, spread in row["spread"].items():
        values = [run[metric] for run in row["runs"]]
        assert row["real"][metric] == statistics.median(values)
        assert spread == (max(values) - min(values)) / statistics.median(values)
    assert report["profile"]["router_overhead_s"] > 0  # calibrated from idle requests


@pytest.mark.slow
def test_speculative_benchmark_quick_run_emits_a_json_report(tmp_path: Path) -> None:
    report = quick_run("speculative.py", tmp_path / "bench-model")
    assert report["benchmark"] == "speculative"
    rows = {(r["method"], r["workload"], r["batch"]) for r in report["rows"]}
    assert ("ngram", "copy", 1) in rows and ("ngram", "random", 2) in rows
    assert ("draft(self)", "copy", 1) in rows
    for row in report["rows"]:  # the benchmark itself asserts the outputs are equal
        assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
    self_draft = [r for r in report["rows"] if r["method"] == "draft(self)"]
    assert all(r["acceptance"] > 0.8 for r in self_draft)


@pytest.mark.slow
def test_kv_tiers_benchmark_quick_run_emits_a_json_report(tmp_path: Path) -> None:
    report = quick_run("kv_tiers.py", tmp_path / "bench-model")
    assert report["benchmark"] == "kv_tiers" and report["same_tokens"] is True
    assert report["off"]["host_hit_tokens"] == 0 and report["host"]["host_hit_tokens"] > 0
    assert report["host"]["prompt_tokens_computed"] < report["off"]["prompt_tokens_computed"]
    dtypes = report["kv_cache_dtype"]["dtypes"]
    assert list(dtypes) == ["float32", "bfloat16", "int8", "fp8_e4m3"]
    assert all(row["transfer_lossless"] for row in dtypes.values())
    for kind in ("int8", "fp8_e4m3"):  # one byte per element plus a 4-byte scale per head_dim
        assert dtypes[kind]["bytes_per_token"] < dtypes["bfloat16"]["bytes_per_token"]
        assert dtypes[kind]["max_concurrent_seqs"] > dtypes["bfloat16"]["max_concurrent_seqs"]
        assert 0 < dtypes[kind]["agreement"] <= 1


@pytest.mark.slow
def test_structured_benchmark_quick_run_times_both_grammar_engines(tmp_path: Path) -> None:
    report = quick_run("structured.py", tmp_path / "bench-model")
    assert [r["batch"] for r in report["tpot"]] == [1, 2]
    assert all(r["tpot_plain_ms"] > 0 and r["tpot_guided_ms"] > 0 for r in report["tpot"])
    assert [s["schema"] for s in report["schemas"]] == ["person", "order", "list"]
    for row in report["schemas"]:  # both engines walked the instance's tokens to its end
        for engine in ("llguidance", "xgrammar"):
            assert row[engine]["compile_ms"] > 0 and row[engine]["mask_mean_us"] > 0


@pytest.mark.slow
def test_slo_control_quick_run_sweeps_both_modes(tmp_path: Path) -> None:
    report = quick_run("slo_control.py", tmp_path / "bench-model")
    assert report["capacity_rps"] > 0 and report["slo_s"] > 0
    for mode in ("on", "off"):
        result = report["modes"][mode]
        assert {"alone", "1x", "4x"} <= set(result)
        for load in ("1x", "4x"):
            for tenant in ("modest", "flood"):
                row = result[load][tenant]
                assert row["sent"] > 0 and row["errors"] == 0
    assert report["modes"]["off"]["4x"]["flood"]["shed_rps"] == 0  # off: nothing is shed
    assert report["overhead_harness_us"] > 0


@pytest.mark.slow
def test_prefix_sharing_quick_run_sweeps_the_policies_and_the_store(tmp_path: Path) -> None:
    report = quick_run("prefix_sharing.py", tmp_path / "bench-model")
    assert set(report["runs"]) == {"round_robin", "cache_aware", "cost", "cost+store"}
    for run in report["runs"].values():
        assert len(run["points"]) == 2 and run["over_ideal"] >= 1.0  # never below the ideal
        for point in run["points"]:
            assert point["requests"] > 0 and point["ttft_p50_s"] > 0
    assert report["runs"]["round_robin"]["points"][0]["pulled_tokens"] == 0  # only cost pulls
    assert set(report["ratios"]) == set(report["store_ratios"]) == set(report["goals"])
