"""Priorities reach vLLM's scheduler: a vLLM worker started with ``--scheduling-policy
priority`` and one seat (``--max-num-seqs 1``) serves a more urgent request before less urgent
ones that arrived before it, and each output is what the same worker produces for it alone
(priority changes the order, never a token)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import grpc

from engine.sampling_params import SamplingParams
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from tests.vllm.conftest import vllm_cluster
from tests.vllm.vllm_util import colocated

PROMPTS = {name: [(17 * i + 11 * k) % 900 + 3 for i in range(40)] for k, name in enumerate("abch")}
PRIORITY = {"a": 5, "b": 5, "c": 5, "h": -1}
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def _served(address: str) -> tuple[list[str], dict[str, list[int]]]:
    """``a`` first; once it holds the only seat, ``b``, ``c`` and ``h`` at once: the order of
    their first tokens and their outputs."""
    order: list[str] = []
    outputs: dict[str, list[int]] = {}
    seated = asyncio.Event()

    async def one(name: str, channel: grpc.aio.Channel) -> None:
        params = dataclasses.replace(PARAMS, priority=PRIORITY[name])
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id=name, prompt_token_ids=PROMPTS[name], sampling=sampling_to_proto(params)
        )
        tokens: list[int] = []
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        async for message in stub.PrefillAndDecode(request, timeout=300):
            if message.tokens.token_ids and not tokens:
                order.append(name)
                seated.set()
            tokens.extend(message.tokens.token_ids)
        outputs[name] = tokens

    async with grpc.aio.insecure_channel(address) as channel:
        first = asyncio.create_task(one("a", channel))
        await seated.wait()  # a holds the only seat: b, c and h all wait behind it
        await asyncio.gather(first, *(one(name, channel) for name in "bch"))
    return order, outputs


def test_a_more_urgent_request_takes_the_next_seat_in_vllm(
    vllm_model: Callable[[str], Path], redis_url: str, tmp_path: Path
) -> None:
    seat = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
    with vllm_cluster(
        vllm_model("llama"), redis_url, tmp_path, colocated=True, decode_args=seat
    ) as cluster:
        address = cluster.decode[0].address

        async def run() -> tuple[list[str], dict[str, list[int]], dict[str, list[int]]]:
            order, outputs = await asyncio.wait_for(_served(address), 300)
            alone = {
                n: (await colocated(address, p, PARAMS, f"{n}1")).token_ids
                for n, p in PROMPTS.items()
            }
            return order, outputs, alone

        order, outputs, alone = asyncio.run(run())
    print(f"\nfirst tokens in order: {order} (arrival: a, then b, c, h at once)")
    assert order[:2] == ["a", "h"], order
    assert outputs == alone
