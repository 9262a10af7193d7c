"""``pdserve up --kv-backend ray``: process-mode workers joined to the session's Ray move KV
through its object store, with the output of one engine."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, router_pb2
from tests.integration.cluster_util import generate_many, run, start_up
from tests.ray_util import no_new_objects

pytestmark = pytest.mark.slow


def test_up_with_ray_transfer_matches_one_engine(
    ray_address: str, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [[3 + i] * (10 + 9 * i) for i in range(6)]
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    requests = [router_pb2.GenerateRequest(prompt_token_ids=p, sampling=sampling) for p in prompts]
    with no_new_objects():
        process, address = start_up(
            "--model", str(llama_dir), "--port", "0", "--kv-backend", "ray",
            "--ray-address", ray_address,
            # Even short prompts disaggregate: every request's KV moves through Ray.
            "--router-args", "--local-prefill-tokens 0",
        )  # fmt: skip
        try:
            results = run(generate_many(address, requests))
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = make_llm(llama_dir).generate(prompts, params)
    assert [r.token_ids for r in results] == [e.token_ids for e in reference]
    assert all(r.transfer_s > 0 for r in results)
