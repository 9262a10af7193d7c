"""``pdserve profile``, ``simulate`` and ``plan`` end to end on the tiny model: a real profile
measured with the engine, a simulation written as ``pdserve bench`` writes its results (and
simulated again from that file), and a plan ending in its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from app.capacity import profile as profile_io


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=600
    )


def test_profile_then_simulate_then_plan(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    done = _pdserve(
        "profile", "--model", str(llama_dir), "--quick", "--kv-backend", "grpc",
        "--num-blocks", "256", "--max-num-seqs", "16", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    profile = profile_io.load(out)
    assert profile.num_blocks == 256 and profile.max_num_seqs == 16
    assert profile.prefill.num_samples >= 4 and profile.decode.num_samples >= 4
    assert profile.transfer.num_samples == 2 and profile.transfer_s(1000) > 0
    assert profile.hardware["kv_backend"] == "grpc" and profile.model_fingerprint
    workload = ["--rate", "4", "--num-requests", "40", "--input-len", "64", "--output-len", "8"]
    slos = ["--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000"]
    sim_dir = tmp_path / "sim"
    done = _pdserve(
        "simulate", "--profile", str(out), "--prefill", "1", "--decode", "1",
        *workload, *slos, "--out", str(sim_dir),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "TTFT (ms)" in done.stdout and "goodput" in done.stdout
    results = json.loads((sim_dir / "results.json").read_text())
    assert results["summary"]["num_completed"] == 40 and results["config"]["simulated"]
    # The recorded run as a workload: the same send times and lengths.
    again = _pdserve(
        "simulate", "--profile", str(out), "--colocated", "2",
        "--workload", str(sim_dir / "results.json"),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr and "40 completed" in again.stdout
    bad = _pdserve("simulate", "--profile", str(out), "--prefill", "1", *workload)
    assert bad.returncode == 2 and "--decode >= 1" in bad.stderr
    plan = _pdserve("plan", "--profile", str(out), *workload, *slos, "--max-workers", "3")
    assert plan.returncode == 0, plan.stderr
    document = json.loads(plan.stdout.strip().splitlines()[-1])
    assert [c["label"] for c in document["candidates"]] == [
        "1P:1D", "1P:2D", "2P:1D", "colocated x1", "colocated x2", "colocated x3",
    ]  # fmt: skip
    recommended = document["recommended"]
    assert recommended["slo_fraction"] >= 0.9 and "helm_values" in recommended
