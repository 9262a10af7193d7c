"""Helpers for tests against a multi-process local cluster."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from app.client import GenerateResult, generate, router_channel
from app.local_cluster import LocalCluster
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def worker_stats(cluster: LocalCluster) -> dict[str, common_pb2.WorkerStats]:
    stats = {}
    for component in [*cluster.prefill, *cluster.decode]:
        async with grpc.aio.insecure_channel(component.address) as channel:
            stub: Any = (
                prefill_pb2_grpc.PrefillWorkerStub(channel)
                if component.name.startswith("prefill")
                else decode_pb2_grpc.DecodeWorkerStub(channel)
            )
            stats[component.name] = await stub.GetStats(common_pb2.GetStatsRequest())
    return stats


async def nothing_held(cluster: LocalCluster) -> bool:
    return all(
        s.num_free_blocks == s.num_blocks and s.num_pinned == 0 and s.num_running == 0
        and s.num_waiting == 0 and s.num_inflight == 0
        for s in (await worker_stats(cluster)).values()
    )  # fmt: skip


async def generate_many(
    address: str, requests: list[router_pb2.GenerateRequest]
) -> list[GenerateResult]:
    async with router_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return list(await asyncio.gather(*(generate(stub, r, timeout_s=300) for r in requests)))


def start_up(
    *flags: str, seen: list[str] | None = None, terminal: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """Runs ``pdserve up FLAGS`` and returns the process and the router address it announced.
    ``seen``: gets every line printed up to the ready line. ``terminal``: in a process group
    of its own, as a shell's foreground job (a Ctrl-C is ``os.killpg(pid, SIGINT)``)."""
    command = [sys.executable, "-m", "app", "up", *flags]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, process_group=0 if terminal else None
    )
    assert process.stdout is not None
    for line in process.stdout:
        if seen is not None:
            seen.append(line)
        if "ready" in line and "router" in line:
            return process, line.split("router ")[1].split(",")[0]
    process.wait()
    raise AssertionError(f"pdserve up exited with {process.returncode} before ready")
