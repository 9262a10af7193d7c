"""Helpers for the vLLM engine's tests: one request through the router (disaggregated) or
colocated on one vLLM worker, vLLM's own offline run as a reference, and the comparison rule."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from app.client import router_channel
from app.local_cluster import Component, LocalCluster
from engine.sampling_params import SamplingParams
from native_engine.diagnostics import NEAR_TIE
from pdserve.common.convert import finish_reason_from_proto, sampling_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from tests.faults.faults_util import requests_for, run_streams, stats, survivors_hold_nothing
from tests.services.harness import wait_for

_ROOT = Path(__file__).resolve().parents[2]
_RESULT = "offline-reference: "


@dataclass
class Run:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # Per token: the gap between the two likeliest raw logprobs (when logprobs >= 2 were asked).
    margins: list[float] = field(default_factory=list)
    cached_tokens: int = 0


def _margin(top_logprobs: list[float]) -> float:
    return top_logprobs[0] - top_logprobs[1] if len(top_logprobs) > 1 else float("inf")


async def through_router(address: str, prompt: list[int], params: SamplingParams) -> Run:
    run = Run()
    async with router_channel(address) as channel:
        request = router_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=sampling_to_proto(params)
        )
        async for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=300):
            if response.HasField("chunk"):
                run.token_ids.extend(response.chunk.token_ids)
                run.text += response.chunk.text
                run.margins += [_margin(list(lp.top_logprobs)) for lp in response.chunk.logprobs]
            else:
                run.finish_reason = finish_reason_from_proto(response.final.finish_reason)
                run.cached_tokens = response.final.usage.cached_tokens
    return run


async def colocated(
    decode_address: str, prompt: list[int], params: SamplingParams, rid: str
) -> Run:
    """One vLLM worker prefills and decodes the request itself (PrefillAndDecode)."""
    run = Run()
    async with grpc.aio.insecure_channel(decode_address) as channel:
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params)
        )
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        async for message in stub.PrefillAndDecode(request, timeout=300):
            tokens = message.tokens
            run.token_ids.extend(tokens.token_ids)
            run.margins += [_margin(list(lp.top_logprobs)) for lp in tokens.logprobs]
            if message.HasField("finished"):
                run.finish_reason = finish_reason_from_proto(message.finished.reason)
    return run


def offline_greedy(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    sampling: dict[str, Any] | None = None,
    tensor_parallel_size: int = 1,
) -> list[Run]:
    """vLLM's own offline run (``vllm.LLM``, no pdserve code in the loop), greedy (with vLLM's
    own penalties and bias where ``sampling`` names them), in a process of its own; run once
    per spec in a test session (tests of other topologies share their reference)."""
    spec: dict[str, Any] = {"model": str(model), "prompts": prompts, "max_tokens": max_tokens}
    spec["tensor_parallel_size"] = tensor_parallel_size
    if sampling:
        spec["sampling"] = sampling
    key = json.dumps(spec, sort_keys=True)
    if key not in _OFFLINE_RUNS:
        _OFFLINE_RUNS[key] = _offline_run(spec)
    return list(_OFFLINE_RUNS[key])


_OFFLINE_RUNS: dict[str, list[Run]] = {}


def _offline_run(spec: dict[str, Any]) -> list[Run]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.offline_reference"],
        cwd=_ROOT,
        # Its engine core in-process, as pdserve runs it: one process to start, not two.
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(_RESULT)]
    rows = json.loads(line[len(_RESULT) :])
    return [Run(token_ids=r["token_ids"], margins=r["margins"]) for r in rows]


def same_or_near_tie(got: Run, want: Run, label: str) -> str | None:
    """Equal tokens; a first difference only where the reference's own choice was a near-tie
    (its two likeliest tokens within NEAR_TIE), and then it is reported, never hidden."""
    if got.token_ids == want.token_ids:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=False)) if a != b),
        min(len(got.token_ids), len(want.token_ids)),
    )
    margin = want.margins[at] if at < len(want.margins) else float("inf")
    assert margin <= NEAR_TIE, (
        f"{label} differs at output {at} (margin {margin:.3g}): "
        f"{got.token_ids[at : at + 5]} vs {want.token_ids[at : at + 5]}"
    )
    return f"{label}: near-tie at output {at} (margin {margin:.2g}), not a bug"


def gone(process: psutil.Process) -> bool:
    """The process exited (a zombie its parent has not reaped counts)."""
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


async def cancel_at_each_stage(cluster: LocalCluster, prompt: list[int]) -> None:
    """A client cancel before the first token, then mid-decode: every block is freed after
    each (``survivors_hold_nothing``)."""
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for stage, tokens_first in (("before the first token", 0), ("mid-decode", 8)):
        streams, tasks = await run_streams(cluster.address, requests_for([prompt], [long]))
        if tokens_first:

            async def streaming(s: list = streams, n: int = tokens_first) -> bool:  # type: ignore[type-arg]
                return len(s[0].token_ids) >= n

            await wait_for(streaming, 60.0, "tokens arrive")
        tasks[0].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tasks[0]
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, f"cancel {stage}: all freed")


async def idle_free_blocks(component: Component) -> int:
    """Once ``component`` holds no request (pinned, running, waiting, in flight): its free
    blocks, the count every test's blocks must come back to."""

    async def idle() -> bool:
        s = await stats(component)
        return (s.num_pinned, s.num_running, s.num_waiting, s.num_inflight) == (0, 0, 0, 0)

    await wait_for(idle, 60.0, f"{component.name} idle")
    return (await stats(component)).num_free_blocks


async def blocks_back(component: Component, free: int, what: str) -> None:
    """Waits (bounded) until ``component`` has ``free`` free blocks and none pinned."""

    async def back() -> bool:
        s = await stats(component)
        return s.num_free_blocks == free and s.num_pinned == 0

    await wait_for(back, 60.0, what)
