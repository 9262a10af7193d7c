"""Speculation on the decode pool of a disaggregated cluster, and a decode worker killed
mid-stream: every stream (greedy and seeded) still gives one plain engine's tokens, the
surviving worker verified guesses, its draft model prefilled the prompts while the target
computed none, and nothing is held afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from native_engine import LLM
from tests.faults.faults_util import kill_a_decode_worker_mid_stream, metric, two_decode_workers

pytestmark = pytest.mark.slow


def test_speculating_decode_pool_killed_mid_stream_every_stream_is_exact(
    llama_dir: Path, redis_url: str, tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    spec = ("--speculative-method", "draft", "--spec-draft-model", str(llama_dir))
    decode_args = (*spec, "--num-speculative-tokens", "4")
    config = two_decode_workers(llama_dir, redis_url, tmp_path, decode_args=decode_args)
    prompts = [[3 + i, *range(60, 60 + 12 + 2 * i)] for i in range(8)]
    with LocalCluster(config) as cluster:
        victim = kill_a_decode_worker_mid_stream(cluster, prompts, make_llm(llama_dir), 300)
        (survivor,) = [c for c in cluster.decode if c.name != victim.name]
        # The survivor decoded by verifying guesses; its draft, not its target, ran the
        # prompts (the prefill pool computed them for the target).
        assert metric(survivor, "pdserve_spec_accepted_tokens_total") > 0
        assert metric(survivor, "pdserve_draft_prompt_tokens_total") > 0
        assert metric(survivor, "pdserve_prompt_tokens_computed") == 0
