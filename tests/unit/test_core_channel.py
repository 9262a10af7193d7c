"""The engine core's half of pdserve's connector when vLLM's engine core runs in a process of its
own: ``HubChannel`` (``vllm_engine/core_channel.py``) tells the front-end's real ``RankHub`` over
real gRPC on a Unix socket which blocks vLLM allocated and pinned, and the front-end's
``Bridge`` turns them into the engine's futures and vLLM's reports. Without vLLM: the calls
are the ones its scheduler half makes in vLLM's step."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from vllm_engine.bridge import Bridge
from vllm_engine.core_channel import HubChannel
from vllm_engine.rank_hub import RankHub

BOUND_S = 30.0


@asynccontextmanager
async def _hub() -> AsyncIterator[tuple[Bridge, RankHub, HubChannel]]:
    bridge = Bridge(asyncio.get_running_loop(), "fp", "test")
    hub = RankHub(1, bridge)
    await hub.start()
    channel = HubChannel(hub.address)
    try:
        yield bridge, hub, channel
    finally:
        await asyncio.to_thread(channel.close)
        await hub.close()
        bridge.close()


def test_an_allocation_reaches_the_waiting_admission_and_its_load_is_reported() -> None:
    async def run() -> None:
        async with _hub() as (bridge, _, channel):
            reported = asyncio.Event()
            bridge.on_report = reported.set
            allocation = bridge.expect_allocation("r1", 1)
            assert channel.should_load("r1")
            channel.allocated("r1", 1, "r1-vllm", [-1, 4, 5], waits=True)
            assert not channel.should_load("r1")  # a preempted request recomputes
            async with asyncio.timeout(BOUND_S):
                assert await allocation == [-1, 4, 5]
            assert bridge.num_loading == 1
            assert bridge.load_finished("r1", 1, ok=True)
            assert reported.is_set()
            reports = bridge.take_reports()
            assert reports.finished_recving == {"r1-vllm"} and not reports.failed_recving
            channel.finished("r1")
            assert channel.should_load("r1")

    asyncio.run(run())


def test_a_pin_reaches_the_bridge_and_the_table_and_its_release_is_reported_once() -> None:
    async def run() -> None:
        async with _hub() as (bridge, hub, channel):
            arrived: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
            hub.on_pinned = lambda rid, attempt: arrived.put_nowait((rid, attempt))
            channel.pin("p1", 4, "p1-vllm", [7, 8])
            async with asyncio.timeout(BOUND_S):
                assert await arrived.get() == ("p1", 4)
            assert bridge.is_pinned("p1", 4) and bridge.pinned("p1") == [7, 8]
            assert not bridge.is_pinned("p1", 3)  # another add of the id
            bridge.release("p1")
            assert bridge.take_reports().finished_sending == {"p1-vllm"}
            assert not bridge.is_pinned("p1", 4)

    asyncio.run(run())


def test_an_allocation_that_comes_after_its_load_was_given_up_is_failed_at_once() -> None:
    """The client cancelled while the engine core allocated: vLLM parked the request and keeps
    its blocks until told its load is over, so the late allocation is reported failed."""

    async def run() -> None:
        async with _hub() as (bridge, _, channel):
            reported = asyncio.Event()
            bridge.on_report = reported.set
            allocation = bridge.expect_allocation("r2", 1)
            assert not bridge.load_finished("r2", 1, ok=False)  # nothing allocated yet
            assert not reported.is_set()
            channel.allocated("r2", 1, "r2-vllm", [3], waits=True)
            async with asyncio.timeout(BOUND_S):
                await reported.wait()
            reports = bridge.take_reports()
            assert reports.finished_recving == {"r2-vllm"} == reports.failed_recving
            assert not allocation.done() and bridge.num_loading == 0

    asyncio.run(run())


def test_an_allocation_with_nothing_to_load_is_not_reported() -> None:
    """vLLM's own prefix cache held every block: it waits for nothing and must not be told."""

    async def run() -> None:
        async with _hub() as (bridge, _, channel):
            allocation = bridge.expect_allocation("r3", 1)
            channel.allocated("r3", 1, "r3-vllm", [-1], waits=False)
            async with asyncio.timeout(BOUND_S):
                assert await allocation == [-1]
            assert not bridge.load_finished("r3", 1, ok=True)
            assert bridge.take_reports().finished_recving == set()

    asyncio.run(run())


def test_a_late_allocation_of_an_earlier_add_of_the_id_is_not_taken_for_the_next() -> None:
    """The id was added again (a retry on this worker) while the engine core's allocation of
    the first add was still on its way: that one is failed at once (vLLM frees its blocks),
    and the waiting admission gets its own add's blocks."""

    async def run() -> None:
        async with _hub() as (bridge, _, channel):
            bridge.expect_allocation("r4", 1)
            assert not bridge.load_finished("r4", 1, ok=False)  # the first add was given up
            bridge.forget("r4")
            allocation = bridge.expect_allocation("r4", 2)
            channel.allocated("r4", 1, "r4-first", [3, 4], waits=True)
            channel.allocated("r4", 2, "r4-second", [5, 6], waits=True)
            async with asyncio.timeout(BOUND_S):
                assert await allocation == [5, 6]
            reports = bridge.take_reports()
            assert reports.finished_recving == {"r4-first"} == reports.failed_recving
            assert bridge.num_loading == 1
            assert bridge.load_finished("r4", 2, ok=True)
            assert bridge.take_reports().finished_recving == {"r4-second"}

    asyncio.run(run())


def test_the_end_of_a_load_is_its_own_adds_whatever_the_order() -> None:
    """An add of the id was aborted while its pull was writing (its end comes later), and the
    id was added again meanwhile: each end reports its own add's blocks, never the other's."""

    async def run() -> None:
        async with _hub() as (bridge, _, channel):
            first = bridge.expect_allocation("r5", 1)
            channel.allocated("r5", 1, "r5-first", [3], waits=True)
            async with asyncio.timeout(BOUND_S):
                assert await first == [3]
            second = bridge.expect_allocation("r5", 2)
            channel.allocated("r5", 2, "r5-second", [4], waits=True)
            async with asyncio.timeout(BOUND_S):
                assert await second == [4]
            assert bridge.num_loading == 2
            assert bridge.load_finished("r5", 1, ok=True)  # the first pull stopped writing
            assert bridge.take_reports().finished_recving == {"r5-first"}
            assert bridge.num_loading == 1
            assert not bridge.load_finished("r5", 1, ok=False)  # once
            assert bridge.load_finished("r5", 2, ok=False)
            reports = bridge.take_reports()
            assert reports.finished_recving == {"r5-second"} == reports.failed_recving

    asyncio.run(run())
