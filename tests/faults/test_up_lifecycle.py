"""``pdserve up``'s processes: each named for what it is; a terminal's Ctrl-C (SIGINT to the
whole foreground group) drains the workers, then stops the router, then Redis, each exiting 0,
with an in-flight stream completed; a ``pdserve up`` killed with SIGKILL leaves no component
behind (each follows its lifeline, ``app/supervised.py``)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import psutil

from app.client import router_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.cluster_util import start_up
from tests.services.harness import wait_for


def _titles(up: psutil.Process) -> list[str]:
    return sorted(" ".join(c.cmdline()).strip() for c in up.children() if "redis" not in c.name())


def test_ctrl_c_drains_workers_then_router_then_redis_each_exiting_zero(llama_dir: Path) -> None:
    process, address = start_up("--model", str(llama_dir), "--port", "0", terminal=True)
    try:
        assert process.stdout is not None
        titles = _titles(psutil.Process(process.pid))
        assert [t.rsplit("-", 1)[0] if "-" in t else t for t in titles] == [
            "pdserve decode-0",
            "pdserve prefill-0",
            "pdserve router",
        ], titles

        async def stream() -> list[int]:
            sampling = common_pb2.SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
            request = router_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling)
            tokens: list[int] = []
            async with router_channel(address) as channel:
                async for response in router_pb2_grpc.RouterStub(channel).Generate(request):
                    if response.HasField("chunk"):
                        if not tokens:  # Ctrl-C: every process of the terminal's group
                            os.killpg(process.pid, signal.SIGINT)
                        tokens.extend(response.chunk.token_ids)
            return tokens

        # The router outlived the decode worker's drain: the stream came through whole.
        assert len(asyncio.run(stream())) == 120
        rest = process.stdout.read()
        assert process.wait(timeout=120) == 0, rest
        assert "restarted" not in rest and "exited with" not in rest, rest
        stopped = next(line for line in rest.splitlines() if line.startswith("stopped: "))
        assert stopped.count(": 0") == 3, stopped  # two workers and the router, each 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_killed_up_leaves_no_component_behind(llama_dir: Path) -> None:
    process, _ = start_up("--model", str(llama_dir), "--port", "0", "--decode", "2")
    children = psutil.Process(process.pid).children(recursive=True)
    assert len(children) >= 5  # three workers, the router, redis-server
    process.kill()
    process.wait()

    async def all_gone() -> bool:
        return not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)

    asyncio.run(wait_for(all_gone, 90.0, "every component of a killed pdserve up gone"))
