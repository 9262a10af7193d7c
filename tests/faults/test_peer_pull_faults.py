"""Peer pull's holder fails (docs/kv-cache.md), real processes: prefill worker B caches a
prompt's prefix and A is asked to pull it from B before computing (the plan's ``PrefixSource``,
sent here directly: the router's part is tests/services/test_peer_pull_routing.py). B frozen
(SIGSTOP: no reset, no answer): A's lease call hits its deadline and A computes the prompt.
B killed (kill -9): the call fails at once and A computes. Either way the decoded tokens are
one engine's, the failure is counted by its reason, and no live worker holds anything."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import prefill_pb2
from tests.faults.faults_util import metric, stats, survivors_hold_nothing
from tests.services.harness import disaggregated, wait_for

pytestmark = pytest.mark.slow
BS = 16
PULL_TIMEOUT_S = 3.0
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=2,
        num_decode=1,
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        prefill_args=("--peer-pull-timeout-s", str(PULL_TIMEOUT_S)),
        max_restarts=0,
    )
    with LocalCluster(config) as c:
        try:
            yield c
        finally:
            for component in [*c.prefill, *c.decode]:  # never leave a stopped process behind
                if component.process.poll() is None:
                    os.kill(component.process.pid, signal.SIGCONT)


@pytest.mark.parametrize(
    ("fault", "reason"), [("frozen", "holder_deadline_exceeded"), ("killed", "holder_unavailable")]
)
def test_a_holder_that_fails_leaves_the_prompt_to_be_computed(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM], fault: str, reason: str
) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1024) for _ in range(18 * BS + 9)]
    want = make_llm(llama_dir).generate([prompt], PARAMS)[0].token_ids
    a, b = cluster.prefill
    decode = cluster.decode[0]

    async def run() -> None:
        # B computes the prompt first: its prefix is cached there.
        assert await disaggregated(b, decode, prompt, PARAMS, "on-b") == want[1:]
        if fault == "frozen":
            os.kill(b.process.pid, signal.SIGSTOP)
        else:
            b.kill()
        source = prefill_pb2.PrefixSource(holder_address=b.address, num_blocks=18)
        assert await disaggregated(a, decode, prompt, PARAMS, "on-a", source) == want[1:]
        assert (await stats(a)).num_prompt_tokens_computed == len(prompt)  # all of it, on A
        if fault == "frozen":
            os.kill(b.process.pid, signal.SIGCONT)
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "nothing held")

    asyncio.run(run())
    assert metric(a, "pdserve_kv_peer_pull_failures_total", f'reason="{reason}"') == 1
    assert metric(a, "pdserve_kv_peer_pull_failures_total") == 1  # the one pull, no retry
