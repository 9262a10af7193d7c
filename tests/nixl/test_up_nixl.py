"""``pdserve up --kv-backend nixl``: every request's KV moves by NIXL READs between the worker
processes, and the output is one engine's, greedy and seeded; the decode worker computes no
prompt token itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from native_engine import LLM
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import router_pb2
from tests.integration.cluster_util import generate_many, run

pytestmark = pytest.mark.slow


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " "))


def test_up_with_nixl_matches_one_engine(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    prompts = [[3 + i] * (10 + 9 * i) for i in range(6)]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
    ]
    requests = [
        router_pb2.GenerateRequest(prompt_token_ids=p, sampling=sampling_to_proto(sp))
        for sp in params
        for p in prompts
    ]
    command = [
        sys.executable, "-m", "app", "up", "--model", str(llama_dir), "--port", "0",
        "--kv-backend", "nixl", "--router-args", "--local-prefill-tokens 0",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    metrics: dict[str, str] = {}
    address = ""
    for line in process.stdout:
        words = line.split()
        if len(words) >= 4 and words[2] == "metrics":
            metrics[words[0]] = words[3]
        if "ready" in line and "router" in line:
            address = line.split("router ")[1].split(",")[0]
            break
    assert address, f"pdserve up exited with {process.wait()}"
    try:
        results = run(generate_many(address, requests))
        decode_computed = _metric(metrics["decode-0"], "pdserve_prompt_tokens_computed")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    llm = make_llm(llama_dir)
    reference = [out for sp in params for out in llm.generate(prompts, sp)]
    assert [r.token_ids for r in results] == [e.token_ids for e in reference]
    assert all(r.transfer_s > 0 for r in results)
    assert decode_computed == 0  # every prompt's KV came from the prefill worker
