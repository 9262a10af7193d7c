"""The serving benchmark runs end to end: vLLM's own client (``vllm bench serve``) drives a
pdserve cluster over the OpenAI API and every request completes (numbers are for benchmarks/,
not for tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_bench_serve_drives_pdserve_to_completion() -> None:
    command = [sys.executable, "benchmarks/serving.py", "--smoke"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "serving" and report["smoke"] is True
    row = report["rows"]["float32"]["random:32:8@4"]["vllm"]["native-colocated"]
    assert "error" not in row, row
    assert row["completed"] == report["num_prompts"] == 6
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"]
    assert 0 < row["tpot_p50_ms"] <= row["tpot_p90_ms"]


def test_offline_engines_benchmark_runs_both_engines() -> None:
    command = [sys.executable, "benchmarks/offline_engines.py", "--quick"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    assert report["copy_gb_s"] > 0 and report["weight_bytes"] > 0
    for row in report["rows"]:
        assert row["native_tok_s"] > 0 and row["vllm_tok_s"] > 0
        assert row["limit_tok_s"] > 0 and row["native_share_of_limit"] > 0
        # the engines took turns: one ratio per repeat, and their median
        assert len(row["pair_ratios"]) == 2 and all(r > 0 for r in row["pair_ratios"])
        assert min(row["pair_ratios"]) <= row["median_pair_ratio"] <= max(row["pair_ratios"])
    assert len(report["copy_gb_s_each_batch"]) == 2
    assert report["copy_gb_s"] == max(report["copy_gb_s_each_batch"])


def test_an_engine_process_that_dies_starting_is_named_not_waited_for(tmp_path: Path) -> None:
    """offline_engines' child engine exits (no model there): the parent says so at once
    rather than waiting out its start timeout."""
    code = (
        "import argparse, pathlib, offline_engines\n"
        "args = argparse.Namespace(dtype='float32', quick=True, prompt_len=16)\n"
        f"offline_engines.EngineProcess('native', pathlib.Path({str(tmp_path / 'absent')!r}), args)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "RuntimeError: native exited (code 1) before it could start" in result.stderr
