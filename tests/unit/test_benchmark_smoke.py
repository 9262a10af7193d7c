"""The engine benchmark runs end to end (numbers are for benchmarks/, not for tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_engine_decode_benchmark_quick_run_emits_a_json_report(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/engine_decode.py",
            "--quick",
            "--model",
            str(tmp_path / "bench-model"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in report["decode"]] == [1, 2]
    for row in report["decode"]:
        assert row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["roofline_tok_s"] > 0
        assert row["greedy_match"] == 1.0  # engine and HF agree on the benchmark prompts too
    assert report["prefill"]["engine_tok_s"] > 0
