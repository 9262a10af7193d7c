"""SIGSTOP of a prefill worker while a decode worker pulls its KV (a frozen process: no TCP reset,
no error; the decode worker's heartbeats keep the admission stream busy, so only the router's
watch on the prefill worker can end the wait): the router gives up on it within the stall
timeout, prefills again on the other prefill worker, and the request completes with one
engine's tokens. After SIGCONT the frozen worker rejoins and nobody holds anything.

A tiny model's pull takes milliseconds, and no worker flag slows one down, so the test does
not race it: the decode worker is held (SIGSTOP) before the request arrives, the prefill
worker is frozen once the first token shows its prefill is over and its KV leased, then the
decode worker resumes and pulls from the frozen one. Every step waits on an observed event."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import (
    compare,
    metric,
    requests_for,
    run_streams,
    stats,
    survivors_hold_nothing,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
STALL_S = 10.0  # well above the 1 s heartbeats and the 2 s stats calls, on a loaded machine too
GIVE_UP_SLACK_S = 5.0  # the stats call that finds it frozen, a loaded machine
FINISH_SLACK_S = 30.0  # then a prefill and a decode elsewhere
# Were the frozen worker not noticed, the pull would end at this deadline (a "transfer"
# migration): far past either bound above.
TRANSFER_TIMEOUT_S = 120.0


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        num_prefill=2,
        num_decode=1,
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        decode_args=("--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)),
        # Every request disaggregated.
        router_args=("--local-prefill-tokens", "0", "--stall-timeout-s", str(STALL_S)),
    )
    with LocalCluster(config) as c:
        try:
            yield c
        finally:
            for component in [*c.prefill, *c.decode]:  # never leave a stopped process behind
                if component.process.poll() is None:
                    os.kill(component.process.pid, signal.SIGCONT)


def test_prefill_worker_frozen_mid_pull_is_given_up_on_within_the_stall_timeout(
    cluster: LocalCluster, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompt = [7, *range(100, 140)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]
    llm = make_llm(llama_dir)
    references = llm.generate([prompt], params)
    request = requests_for([prompt], params)[0]
    decode = cluster.decode[0]

    async def run() -> None:
        # Undisturbed first: its tokens are the engine's, and every lease of it is gone.
        undisturbed, tasks = await run_streams(cluster.address, [request])
        await asyncio.gather(*tasks)
        print("\n".join(compare(llm, undisturbed, references, params)))
        await wait_for(lambda: survivors_hold_nothing(cluster), 30.0, "nothing held anywhere")
        stalls = metric(cluster.router, "pdserve_migrations_total", 'reason="stall"')
        transfers = metric(cluster.router, "pdserve_migrations_total", 'reason="transfer"')
        computed = [(await stats(c)).num_prompt_tokens_computed for c in cluster.prefill]

        # The decode worker takes the Decode call only once resumed: the pull cannot begin
        # before the prefill worker is frozen.
        os.kill(decode.process.pid, signal.SIGSTOP)
        (stream,), (task,) = await run_streams(cluster.address, [request], timeout_s=300.0)

        async def first_token() -> bool:
            assert not task.done(), f"the stream ended early: {stream}"
            return bool(stream.token_ids)

        # The first token comes with the Prefill answer: the prefill is over, its KV leased.
        await wait_for(first_token, 60.0, "the first token", poll_s=0.005)
        pinned = [(await stats(c)).num_pinned for c in cluster.prefill]
        assert sorted(pinned) == [0, 1], pinned  # one prefill worker holds the KV to pull
        victim, other = (cluster.prefill[pinned.index(n)] for n in (1, 0))
        os.kill(victim.process.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        os.kill(decode.process.pid, signal.SIGCONT)

        async def pulling() -> bool:
            return (await stats(decode)).num_inflight > 0

        # The decode worker admitted the request and pulls from the frozen worker.
        await wait_for(pulling, 30.0, "the decode worker pulls", poll_s=0.005)
        assert len(stream.token_ids) == 1 and not task.done()

        async def given_up() -> bool:
            now = metric(cluster.router, "pdserve_migrations_total", 'reason="stall"')
            return now > stalls

        await wait_for(given_up, STALL_S + GIVE_UP_SLACK_S, "the router gave up", poll_s=0.05)
        gave_up_s = time.monotonic() - frozen_at
        async with asyncio.timeout(STALL_S + FINISH_SLACK_S - gave_up_s):
            await task
        finished_s = time.monotonic() - frozen_at
        print(f"frozen prefill worker given up on after {gave_up_s:.1f} s, done {finished_s:.1f} s")
        assert gave_up_s <= STALL_S + GIVE_UP_SLACK_S
        assert finished_s <= STALL_S + FINISH_SLACK_S

        print("\n".join(compare(llm, [stream], references, params)))
        assert stream.token_ids == undisturbed[0].token_ids
        assert stream.final is not None and stream.final.num_migrations == 1
        # Given up on as frozen (not at the pull's own deadline: a "transfer" migration).
        assert metric(cluster.router, "pdserve_migrations_total", 'reason="stall"') == stalls + 1
        assert metric(cluster.router, "pdserve_migrations_total", 'reason="transfer"') == transfers
        # The other prefill worker prefilled it again; the frozen one is still frozen.
        assert (await stats(other)).num_prompt_tokens_computed > computed[pinned.index(0)]
        assert victim.process.poll() is None

        os.kill(victim.process.pid, signal.SIGCONT)

        async def rejoined() -> bool:
            return metric(cluster.router, "pdserve_router_healthy_workers", 'pool="prefill"') == 2

        await wait_for(rejoined, 30.0, "the resumed prefill worker rejoins", poll_s=0.1)
        # Its lease ends (released, or by expiry), and the decode worker freed the first pull.
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "nothing held anywhere")

    asyncio.run(run())
