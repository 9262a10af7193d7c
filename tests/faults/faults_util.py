"""Helpers for fault tests: streams whose progress the test can watch, reference outputs, the
near-tie check for migrated streams, metric scrapes, and leak checks on the survivors."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from app.client import router_channel
from app.local_cluster import ClusterConfig, Component, LocalCluster
from engine import SamplingParams
from engine.outputs import RequestOutput
from engine.structured_output import StructuredKind, StructuredOutput
from native_engine import LLM
from pdserve.common.convert import finish_reason_from_proto, sampling_to_proto
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from tests.identical import same_or_near_tie
from tests.services.harness import wait_for


def two_decode_workers(
    llama_dir: Path,
    redis_url: str,
    tmp_path: Path,
    *,
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    router_args: tuple[str, ...] = (),
) -> ClusterConfig:
    """One prefill worker and two decode workers on the session's Redis (a namespace of their
    own), every stream disaggregated: the cluster a decode worker is killed or stopped in."""
    return ClusterConfig(
        model=str(llama_dir),
        num_prefill=1,
        num_decode=2,
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        prefill_args=prefill_args,
        decode_args=decode_args,
        router_args=("--local-prefill-tokens", "0", *router_args),
    )


@dataclass
class Stream:
    """One client stream, as it arrives."""

    request: router_pb2.GenerateRequest
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: grpc.aio.AioRpcError | None = None
    final: router_pb2.GenerateFinal | None = None


async def run_streams(
    address: str, requests: list[router_pb2.GenerateRequest], timeout_s: float = 300.0
) -> tuple[list[Stream], list[asyncio.Task[None]]]:
    """Starts every stream; returns their live records and tasks (await them to finish)."""
    streams = [Stream(r) for r in requests]
    channel = router_channel(address)
    stub = router_pb2_grpc.RouterStub(channel)

    async def one(stream: Stream) -> None:
        try:
            async for response in stub.Generate(stream.request, timeout=timeout_s):
                if response.HasField("chunk"):
                    stream.token_ids.extend(response.chunk.token_ids)
                    stream.text += response.chunk.text
                else:
                    stream.final = response.final
                    stream.finish_reason = finish_reason_from_proto(response.final.finish_reason)
        except grpc.aio.AioRpcError as exc:
            stream.error = exc

    tasks = [asyncio.create_task(one(s)) for s in streams]

    async def close_channel() -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()

    asyncio.get_running_loop().create_task(close_channel())
    return streams, tasks


def requests_for(
    prompts: list[list[int]], params: list[SamplingParams]
) -> list[router_pb2.GenerateRequest]:
    return [
        router_pb2.GenerateRequest(prompt_token_ids=p, sampling=sampling_to_proto(s))
        for p, s in zip(prompts, params, strict=True)
    ]


# A constraint no output completes before max_tokens: a guided stream runs its full length.
OPEN_REGEX = StructuredOutput(StructuredKind.REGEX, "[a-z ,.]+", "guided_regex")


def mixed_params(n: int, max_tokens: int, guided: bool = True) -> list[SamplingParams]:
    """Half greedy, half seeded top-p/top-k sampling; every second of each also penalized
    (presence, frequency, repetition, a bias): a migrated stream's earlier output must count
    as output on the worker that continues it. With ``guided``, streams 3 and 4 of every
    eight (one seeded and penalized, one greedy) are held to a regular expression: the
    continuing worker must replay its matcher over the earlier output."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.8,
                top_p=0.95,
                top_k=50,
                seed=100 + i,
                ignore_eos=True,
            )
        if i % 4 >= 2:
            params = dataclasses.replace(
                params,
                presence_penalty=0.4,
                frequency_penalty=0.3,
                repetition_penalty=1.2,
                logit_bias={7 + i: 1.0},
            )
        if guided and i % 8 in (3, 4):
            params = dataclasses.replace(params, structured=OPEN_REGEX)
        out.append(params)
    return out


def compare(
    llm: LLM,
    streams: list[Stream],
    references: list[RequestOutput],
    params: list[SamplingParams],
) -> list[str]:
    """Every stream must equal its reference (``tests/identical.py``). Returns the reports."""
    reports = []
    for i, (stream, ref, p) in enumerate(zip(streams, references, params, strict=True)):
        assert stream.error is None, f"stream {i}: {stream.error}"
        prompt = list(stream.request.prompt_token_ids)
        report = same_or_near_tie(
            llm, prompt, stream.token_ids, stream.text, stream.finish_reason, ref, p,
            f"stream {i}",
        )  # fmt: skip
        if report is not None:
            reports.append(report)
    return reports


def metric(component: Component | None, name: str, label: str = "") -> float:
    """The sum of a Prometheus sample family on a component (0 when absent)."""
    assert component is not None and component.metrics_address
    with urllib.request.urlopen(f"http://{component.metrics_address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    values = [
        float(line.split()[-1])
        for line in lines
        if (line.startswith(name + " ") or line.startswith(name + "{")) and label in line
    ]
    return sum(values)


async def restarted(cluster: LocalCluster, victim: Component) -> bool:
    """The supervisor's replacement for ``victim`` serves."""
    replacement = next(c for c in cluster.components if c.name == victim.name)
    return replacement is not victim and bool(replacement.address)


async def stats(component: Component) -> common_pb2.WorkerStats:
    async with grpc.aio.insecure_channel(component.address) as channel:
        stub = (  # a KV store answers the prefill worker's GetStats
            decode_pb2_grpc.DecodeWorkerStub(channel)
            if component.role is Role.DECODE
            else prefill_pb2_grpc.PrefillWorkerStub(channel)
        )
        return await stub.GetStats(common_pb2.GetStatsRequest(), timeout=10)


async def survivors_hold_nothing(cluster: LocalCluster) -> bool:
    """Every live, ready worker: no block referenced, no request, no lease."""
    for component in [*cluster.prefill, *cluster.decode]:
        if component.process.poll() is not None or not component.address:
            continue
        s = await stats(component)
        if (s.num_free_blocks, s.num_pinned, s.num_running, s.num_waiting, s.num_inflight) != (
            s.num_blocks, 0, 0, 0, 0
        ):  # fmt: skip
            return False
    return True


def kill_a_decode_worker_mid_stream(
    cluster: LocalCluster, prompts: list[list[int]], llm: LLM, max_tokens: int = 160
) -> Component:
    """kill -9 of the decode worker with the most streams once every stream has tokens: each
    stream must still give one engine's tokens (migration), the supervisor restarts the
    worker, and afterwards nobody holds anything. Returns the killed worker."""
    params = mixed_params(len(prompts), max_tokens=max_tokens)
    references = llm.generate(prompts, params)
    streams, victim = asyncio.run(kill_the_busiest_decode_worker(cluster, prompts, params))
    print("\n".join(compare(llm, streams, references, params)))
    return victim


async def busiest_decode_worker_mid_stream(
    cluster: LocalCluster, streams: list[Stream]
) -> Component:
    """Once every stream has tokens: the decode worker running the most of them (on a loaded
    box the router may have placed every stream on one)."""

    async def all_streaming() -> bool:
        return all(len(s.token_ids) >= 8 for s in streams)

    await wait_for(all_streaming, 120.0, "every stream has tokens", poll_s=0.005)
    running = [(await stats(c)).num_running for c in cluster.decode]
    assert max(running) > 0  # streams were on it
    return cluster.decode[running.index(max(running))]


async def kill_the_busiest_decode_worker(
    cluster: LocalCluster,
    prompts: list[list[int]],
    params: list[SamplingParams],
    restart_s: float = 120.0,
    kill: Callable[[Component], None] | None = None,
) -> tuple[list[Stream], Component]:
    """Streams ``prompts`` and, once every stream has tokens, kill -9s the decode worker running
    the most of them (or ``kill``s it: one of its processes). Every stream finishes without
    error (migration; the caller compares the tokens), the supervisor restarts the worker and
    afterwards nobody holds anything."""
    streams, tasks = await run_streams(cluster.address, requests_for(prompts, params))
    victim = await busiest_decode_worker_mid_stream(cluster, streams)
    if kill is None:
        victim.process.send_signal(signal.SIGKILL)
    else:
        kill(victim)
    await asyncio.gather(*tasks)
    for i, stream in enumerate(streams):
        assert stream.error is None, f"stream {i}: {stream.error}"
    assert metric(cluster.router, "pdserve_migrations_total") >= 1
    await wait_for(lambda: restarted(cluster, victim), restart_s, "the killed worker restarted")
    await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "survivors hold nothing")
    return streams, victim
