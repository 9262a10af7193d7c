"""A frozen router (SIGSTOP: no reset, no error, as behind a partition) cannot make workers
hold its requests' KV for ever: the workers' servers ping their callers (``--keepalive-s``)
and cut a caller that does not answer, so its calls are cancelled and every block freed
within 2 x keepalive_s. After SIGCONT the router serves again (its streams were lost to it;
the client sees errors, not a hang).

Before, internal servers set no keepalive (gRPC's default is 2 hours): what freed a frozen
router's requests was only incidental."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.local_cluster import ClusterConfig, LocalCluster
from tests.faults.faults_util import (
    mixed_params,
    requests_for,
    run_streams,
    stats,
    survivors_hold_nothing,
)
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow
KEEPALIVE_S = 2.0


@pytest.fixture
def cluster(llama_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[LocalCluster]:
    keepalive = ("--keepalive-s", str(KEEPALIVE_S))
    config = ClusterConfig(
        model=str(llama_dir),
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        prefill_args=keepalive,
        # A small output buffer: the frozen router stops reading, the requests pause.
        decode_args=(*keepalive, "--max-buffered-tokens", "8"),
        router_args=("--local-prefill-tokens", "0"),
    )
    with LocalCluster(config) as c:
        try:
            yield c
        finally:
            if c.router is not None and c.router.process.poll() is None:
                os.kill(c.router.process.pid, signal.SIGCONT)


def test_workers_free_a_frozen_routers_requests_within_the_keepalive_bound(
    cluster: LocalCluster,
) -> None:
    prompts = [[3 + i, *range(40, 60)] for i in range(4)]
    # 20 logprobs a token: the frozen router's 16 KiB HTTP/2 windows fill within tens of
    # tokens, so the requests pause on the worker (held) instead of finishing.
    params = [
        dataclasses.replace(p, logprobs=20)
        for p in mixed_params(4, max_tokens=400)  # the tiny model's context is 512
    ]
    router = cluster.router
    assert router is not None
    decode = cluster.decode[0]

    async def run() -> None:
        streams, tasks = await run_streams(
            cluster.address, requests_for(prompts, params), timeout_s=120
        )

        async def streaming() -> bool:
            return all(len(s.token_ids) >= 4 for s in streams)

        await wait_for(streaming, 60.0, "every stream has tokens", poll_s=0.01)
        os.kill(router.process.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()

        async def freed() -> bool:
            s = await stats(decode)
            return s.num_running + s.num_paused + s.num_waiting == 0 and s.num_inflight == 0

        async def paused_or_freed() -> bool:
            # The windows full, the buffers full: held, not running. On a loaded box the
            # keepalive can cut the caller before all four reach that point; then they are
            # already freed, which is what this test is about.
            return (await stats(decode)).num_paused == 4 or await freed()

        await wait_for(paused_or_freed, 60.0, "the frozen router's requests pause or are freed")

        await wait_for(freed, 2 * KEEPALIVE_S + 30.0, "the decode worker frees them")
        freed_s = time.monotonic() - frozen_at
        print(f"the frozen router's 4 requests freed {freed_s:.1f} s after the SIGSTOP")
        assert freed_s < 2 * KEEPALIVE_S + 30.0
        after = await stats(decode)
        assert after.num_free_blocks == after.num_blocks  # cached blocks count as free

        os.kill(router.process.pid, signal.SIGCONT)
        await asyncio.gather(*tasks)  # the clients see errors or ends, never a hang
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "nothing held anywhere")
        again, more = await run_streams(cluster.address, requests_for(prompts[:1], params[:1]))
        await asyncio.gather(*more)
        assert again[0].error is None and len(again[0].token_ids) == 400

    asyncio.run(run())
