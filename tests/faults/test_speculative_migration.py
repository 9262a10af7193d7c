"""Speculation on the decode pool of a disaggregated cluster, and a decode worker killed
mid-stream: every stream (greedy and seeded) still gives one plain engine's tokens, the
surviving worker verified guesses, its draft model prefilled the prompts while the target
computed none, and nothing is held afterwards."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM
from pdserve.app.local_cluster import ClusterConfig, LocalCluster
from tests.faults.faults_util import (
    compare,
    metric,
    mixed_params,
    requests_for,
    restarted,
    run_streams,
    stats,
    survivors_hold_nothing,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow


def test_speculating_decode_pool_killed_mid_stream_every_stream_is_exact(
    llama_dir: Path, redis_url: str, tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    spec = ("--speculative-method", "draft", "--spec-draft-model", str(llama_dir))
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=1,
        num_decode=2,
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        decode_args=(*spec, "--num-speculative-tokens", "4"),
        router_args=("--local-prefill-tokens", "0"),  # every stream disaggregated
    )
    prompts = [[3 + i, *range(60, 60 + 12 + 2 * i)] for i in range(8)]
    params = mixed_params(len(prompts), max_tokens=300)
    llm = make_llm(llama_dir)
    references = llm.generate(prompts, params)
    with LocalCluster(config) as cluster:

        async def run() -> None:
            streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))

            async def all_streaming() -> bool:
                return all(len(s.token_ids) >= 8 for s in streams)

            await wait_for(all_streaming, 120.0, "every stream has tokens", poll_s=0.005)
            running = [(await stats(c)).num_running for c in cluster.decode]
            assert max(running) > 0
            victim = cluster.decode[running.index(max(running))]
            survivor = next(c for c in cluster.decode if c is not victim)
            victim.process.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks)
            print("\n".join(compare(llm, streams, references, params)))
            assert metric(cluster.router, "pdserve_migrations_total") >= 1
            # The survivor decoded by verifying guesses; its draft, not its target, ran
            # the prompts (the prefill pool computed them for the target).
            assert metric(survivor, "pdserve_spec_accepted_tokens_total") > 0
            assert metric(survivor, "pdserve_draft_prompt_tokens_total") > 0
            assert metric(survivor, "pdserve_prompt_tokens_computed") == 0
            await wait_for(lambda: restarted(cluster, victim), 120.0, "the victim restarted")
            await wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "nothing held")

        asyncio.run(run())
