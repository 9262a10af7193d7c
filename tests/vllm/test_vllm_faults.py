"""The vLLM engine's loop dies at once, whatever fails in it: an exception delivering a
request's output (``--fault-raise-on-token``) marks the engine dead, the worker leaves and the
router hears its last words (that request alone): the request ends after one worker, named,
instead of every stream on the worker hanging while heartbeats go on (before: the step task
ended silently, /livez stayed 200, new requests were still admitted). The other worker serves
the next request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from engine.sampling_params import SamplingParams
from tests.services.harness import wait_for
from tests.vllm.conftest import vllm_cluster
from tests.vllm.vllm_util import through_router

POISON = 7
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_a_failed_delivery_kills_the_engine_and_costs_one_worker(
    vllm_model: Callable[[str], Path], redis_url: str, tmp_path: Path
) -> None:
    fault = ("--fault-raise-on-token", str(POISON))
    with vllm_cluster(
        vllm_model("llama"),
        redis_url,
        tmp_path,
        num_decode=2,
        colocated=True,
        decode_args=fault,
        max_restarts=0,
    ) as cluster:

        async def run() -> None:
            poison = [*range(20, 40), POISON, *range(40, 60)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(through_router(cluster.address, poison, PARAMS), 120)
            assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
            assert "request quarantined" in (err.value.details() or "")

            async def one_exited() -> bool:
                return sum(c.process.poll() is not None for c in cluster.decode) == 1

            await wait_for(one_exited, 60.0, "the worker whose engine died exits")
            normal = await through_router(cluster.address, list(range(100, 140)), PARAMS)
            assert len(normal.token_ids) == PARAMS.max_tokens

        asyncio.run(run())
