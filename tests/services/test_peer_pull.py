"""Peer pull through the real services (docs/kv-cache.md): prefill worker A is asked to pull
the prompt's cached prefix from prefill worker B before computing it. A computes only the rest,
the decoded output is one engine's, and every failure (an unknown holder, a holder whose blocks
were evicted, a holder gone) falls back to computing the prompt; no block leaks on any side."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from engine import SamplingParams
from native_engine import LLM
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from tests.services.harness import (
    all_blocks_free,
    both_sides_freed,
    decode_stub,
    disaggregated,
    prefill_stub,
    prefilled_request,
    start_decode,
    start_prefill,
    wait_for,
)

PROMPT = list(range(3, 300))  # 297 tokens: 18 whole blocks of 16 before the last token
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


async def _computed(server: object) -> int:
    stats = await prefill_stub(server).GetStats(common_pb2.GetStatsRequest())
    return int(stats.num_prompt_tokens_computed)


@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
def test_a_prefix_pulled_from_a_peer_is_computed_once_and_decodes_the_same(
    llama_dir: Path, make_llm: Callable[..., LLM], params: SamplingParams
) -> None:
    want = make_llm(llama_dir).generate([PROMPT], params)[0].token_ids

    async def run() -> None:
        b, b_server = await start_prefill(llama_dir)
        a, a_server = await start_prefill(llama_dir, prefill_peers=(b.address,))
        _, d_server = await start_decode(llama_dir, peers=[a_server, b_server])
        try:
            assert await disaggregated(b_server, d_server, PROMPT, params, "on-b") == want[1:]
            source = prefill_pb2.PrefixSource(holder_address=b.address, num_blocks=18)
            request = await prefilled_request(a_server, PROMPT, params, "on-a", source)
            assert request.first_token_id == want[0]
            assert await _computed(a_server) == len(PROMPT) - 18 * 16  # the rest only
            tokens = [
                t async for r in decode_stub(d_server).Decode(request) for t in r.tokens.token_ids
            ]
            assert tokens == want[1:]
            await both_sides_freed(a_server, d_server)
            await both_sides_freed(b_server, d_server)
            assert not a.leases and not b.leases
        finally:
            for server in (d_server, a_server, b_server):
                await server.shutdown()

    asyncio.run(run())


def test_a_pull_that_cannot_happen_computes_the_prompt_instead(llama_dir: Path) -> None:
    p1, p2, p3, q = (list(range(start, start + 297)) for start in (3, 303, 603, 700))

    async def run() -> None:
        # 24 blocks: one more prompt of 19 evicts most of the last one's.
        b, b_server = await start_prefill(llama_dir, num_blocks=24)
        a, a_server = await start_prefill(llama_dir, prefill_peers=(b.address,))
        _, d_server = await start_decode(llama_dir, peers=[a_server, b_server])
        b_free = lambda: all_blocks_free(prefill_stub(b_server))  # noqa: E731
        try:
            want = {}
            for name, prompt in (("p1", p1), ("p3", p3), ("p2", p2), ("q", q)):
                want[name] = await disaggregated(b_server, d_server, prompt, PARAMS, name)
                await wait_for(b_free, 30.0, "B's lease released")
            # An address no registry or flag names: never dialled; A computes all of p1.
            stranger = prefill_pb2.PrefixSource(holder_address="127.0.0.1:9", num_blocks=18)
            got = await disaggregated(a_server, d_server, p1, PARAMS, "x", stranger)
            assert got == want["p1"] and await _computed(a_server) == 297
            # B computed q after p2 and kept only p2's first 5 blocks: it lends those.
            source = prefill_pb2.PrefixSource(holder_address=b.address, num_blocks=18)
            got = await disaggregated(a_server, d_server, p2, PARAMS, "y", source)
            assert got == want["p2"] and await _computed(a_server) == 297 + 297 - 5 * 16
            # The holder is gone: A computes all of p3.
            await b_server.shutdown()
            got = await disaggregated(a_server, d_server, p3, PARAMS, "z", source)
            assert got == want["p3"] and await _computed(a_server) == 2 * 297 - 80 + 297
            await wait_for(lambda: all_blocks_free(prefill_stub(a_server)), 30.0, "A freed")
            assert not a.leases and not b.leases
        finally:
            for server in (d_server, a_server, b_server):
                await server.shutdown()

    asyncio.run(run())


def test_a_prefix_in_the_holders_host_tier_is_pulled_too(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    p1, p2 = list(range(3, 300)), list(range(303, 600))
    want = make_llm(llama_dir).generate([p1], PARAMS)[0].token_ids

    async def run() -> None:
        # 24 device blocks: p2 after p1 evicts p1's blocks to B's host tier.
        b, b_server = await start_prefill(llama_dir, num_blocks=24, host_cache_gib=0.05)
        a, a_server = await start_prefill(llama_dir, prefill_peers=(b.address,))
        _, d_server = await start_decode(llama_dir, peers=[a_server, b_server])
        try:
            for name, prompt in (("p1", p1), ("p2", p2)):
                await disaggregated(b_server, d_server, prompt, PARAMS, name)
                await wait_for(lambda: all_blocks_free(prefill_stub(b_server)), 30.0, "B free")
            assert (
                b.engine.stats.num_host_cached_blocks > 0 == b.engine.stats.num_host_loaded_blocks
            )
            source = prefill_pb2.PrefixSource(holder_address=b.address, num_blocks=18)
            got = await disaggregated(a_server, d_server, p1, PARAMS, "on-a", source)
            assert got == want[1:]
            assert await _computed(a_server) == len(p1) - 18 * 16  # all 18 blocks came from B
            assert b.engine.stats.num_host_loaded_blocks >= 13  # most of them from its host tier
            await both_sides_freed(a_server, d_server)
            await both_sides_freed(b_server, d_server)
            assert not a.leases and not b.leases
        finally:
            for server in (d_server, a_server, b_server):
                await server.shutdown()

    asyncio.run(run())


def test_lease_prefix_refuses_bad_input_by_name(llama_dir: Path) -> None:
    async def run() -> None:
        b, b_server = await start_prefill(llama_dir)
        stub = prefill_stub(b_server)
        try:
            for ids, field in (
                ([], "whole blocks"),
                (list(range(3, 20)), "whole blocks"),  # 17 tokens
                ([5000] * 16, "vocabulary"),
            ):
                request = prefill_pb2.LeasePrefixRequest(prompt_token_ids=ids, first_block=0)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.LeasePrefix(request)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert field in (caught.value.details() or "")
            # Nothing cached: no lease, nothing pinned.
            empty = await stub.LeasePrefix(
                prefill_pb2.LeasePrefixRequest(prompt_token_ids=list(range(3, 35)))
            )
            assert not empty.HasField("lease") and not b.leases
        finally:
            await b_server.shutdown()

    asyncio.run(run())


def test_a_local_prefill_pulls_its_prefix_from_a_peer_first(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """A decode worker asked to prefill locally (``PrefillAndDecode``) with a ``PrefixSource``
    pulls the prefix from the holder, computes only the rest, and streams one engine's
    tokens; an unknown holder costs a recompute."""
    want = make_llm(llama_dir).generate([PROMPT], PARAMS)[0].token_ids

    async def run() -> None:
        b, b_server = await start_prefill(llama_dir)
        _, d_server = await start_decode(llama_dir, peers=[b_server])
        stub = decode_stub(d_server)

        async def local(request_id: str, holder: str) -> list[int]:
            source = prefill_pb2.PrefixSource(holder_address=holder, num_blocks=18)
            request = decode_pb2.PrefillAndDecodeRequest(
                request_id=request_id,
                prompt_token_ids=PROMPT,
                sampling=sampling_to_proto(PARAMS),
                prefix=source,
            )
            return [t async for r in stub.PrefillAndDecode(request) for t in r.tokens.token_ids]

        try:
            assert await disaggregated(b_server, d_server, PROMPT, PARAMS, "on-b") == want[1:]
            await both_sides_freed(b_server, d_server)
            assert await local("local", b.address) == want
            stats = await stub.GetStats(common_pb2.GetStatsRequest())
            assert stats.num_prompt_tokens_computed == len(PROMPT) - 18 * 16  # the rest only
            assert await local("unknown", "127.0.0.1:9") == want  # its own cache now: a hit
            await both_sides_freed(b_server, d_server)
        finally:
            for server in (d_server, b_server):
                await server.shutdown()

    asyncio.run(run())
